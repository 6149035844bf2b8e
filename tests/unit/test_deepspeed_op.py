"""tests/deepspeed_op.py: a build lock left by a killed build of DeepSpeed's CPU comm op is named when a
test session starts (a DeepSpeed start would wait on it for ever); one of a build under way is not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests import deepspeed_op
from tests.deepspeed_op import OP, ROOT, STALE_AFTER_S, stale_lock


def left_lock(directory, age_s: float):
    lock = directory / OP / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_lock_older_than_any_build_is_named_with_the_fix(tmp_path):
    lock = left_lock(tmp_path, STALE_AFTER_S + 60)
    message = stale_lock(tmp_path)
    assert message is not None and str(lock) in message and f"rm {lock}" in message


def test_no_lock_or_a_build_under_way_is_no_stale_lock(tmp_path):
    assert stale_lock(tmp_path) is None
    left_lock(tmp_path, 5)
    assert stale_lock(tmp_path) is None


def test_the_session_uses_the_projects_extensions_dir_unless_told_otherwise():
    assert deepspeed_op.extensions_dir({}) == ROOT / ".tools" / "torch_extensions"
    assert deepspeed_op.extensions_dir({"TORCH_EXTENSIONS_DIR": "/x"}) == Path("/x")
    assert os.environ["TORCH_EXTENSIONS_DIR"]  # tests/conftest.py set it for this session and its ranks


def test_a_session_stops_at_its_start_naming_a_stale_lock(tmp_path):
    lock = left_lock(tmp_path, STALE_AFTER_S + 60)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_layout.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 4 and str(lock) in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
