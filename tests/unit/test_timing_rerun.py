"""tests/conftest.py's second chance for timing tests: only when timing tests alone failed, once, in a
fresh process; any other failure, or a timing test failing twice, still fails the session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parent.parent / "conftest.py"

FLAKY = '''
import os, pytest
pytestmark = pytest.mark.timing

def test_fails_the_first_time():
    flag = os.path.join(os.environ["FLAG_DIR"], "ran")
    first = not os.path.exists(flag)
    open(flag, "w").close()
    assert not first, "a host that took the CPU"
'''
ALWAYS_FAILS = '''
import pytest

@pytest.mark.timing
def test_always_slow():
    assert False, "a real regression"
'''
PLAIN_FAILURE = '''
def test_logic():
    assert 1 + 1 == 3
'''


def run(tmp_path: Path, files: dict) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    timing: wall-clock test\n")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "PARWATCH_TIMING_RERUN"}
    env["FLAG_DIR"] = str(tmp_path)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("files,code,said", [
    ({"test_flaky.py": FLAKY}, 0, "timing re-run: passed"),
    ({"test_flaky.py": FLAKY, "test_plain.py": PLAIN_FAILURE}, 1, None),  # another failure: no second chance
    ({"test_slow.py": ALWAYS_FAILS}, 1, "timing re-run: failed again"),
])
def test_only_timing_failures_get_one_more_run(tmp_path, files, code, said):
    proc = run(tmp_path, files)
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-2000:]
    if said is None:
        assert "timing re-run" not in proc.stdout
    else:
        assert said in proc.stdout and "failed" in proc.stdout  # the first failure stays in the output
