"""parwatch imports cleanly from a directory that holds the user's own `trainer.py`.

`trainer.py` is a common name for a user's training script. parwatch's bundled reference trainer is
`parwatch.trainer` (no top-level `trainer`), so nothing of parwatch, the bundled trainer included, picks
up the user's file; the name stays the user's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = (
    "parwatch.collector",
    "parwatch.integrations.torch_pipelining",
    "parwatch.pipeline_sim",
    "parwatch.contract",
    "parwatch.trainer.launch",
    "parwatch.trainer.train",
    "parwatch.cli.train",
)


@pytest.mark.parametrize("module", MODULES)
def test_imports_beside_a_hostile_trainer_py(tmp_path, module):
    (tmp_path / "trainer.py").write_text("raise RuntimeError('the user trainer.py was imported by parwatch')\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    code = f"import {module}, sys; assert 'trainer' not in sys.modules, sorted(sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_hostile_file_is_really_found_first(tmp_path):
    """Guard against a vacuous pass: from that directory, `import trainer` is the user's file."""
    (tmp_path / "trainer.py").write_text("raise RuntimeError('the user trainer.py')\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, "-c", "import trainer"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "the user trainer.py" in done.stderr
