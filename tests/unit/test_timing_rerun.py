"""tests/timing_rerun.py, run on small sessions of their own: one more run only for wall-clock tests that
alone failed; never after -x, for a timeout, or a setup error; the caller's -m passes through; exit code,
last line, JUnit XML and the re-run log agree."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent

FLAKY = """
import os, pytest

@pytest.mark.timing
def test_fails_the_first_time():
    flag = os.path.join(os.environ["FLAG_DIR"], "ran")
    first = not os.path.exists(flag)
    open(flag, "w").close()
    assert not first, "a host that took the CPU"
"""
ALWAYS_FAILS = """
import pytest

@pytest.mark.timing
def test_always_slow():
    assert False, "a real regression"
"""
PLAIN_FAILURE = """
def test_logic():
    assert 1 + 1 == 3
"""
TIMES_OUT = """
import time, pytest

@pytest.mark.timing
@pytest.mark.timeout(1)
def test_deadlocks():
    time.sleep(30)
"""
SETUP_ERROR = """
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("a fixture that cannot start")

@pytest.mark.timing
def test_needs_it(broken):
    pass
"""
MISSED_DEADLINE = FLAKY.replace(
    'assert not first, "a host that took the CPU"',
    'wait_until(lambda: not first, "a hang finding", timeout=0.2)',
).replace("import os, pytest", "import os, pytest\nfrom deadline import wait_until")
NOT_AN_ASSERTION = FLAKY.replace(
    'assert not first, "a host that took the CPU"', 'if first:\n        raise KeyError("culprit")'
)
TIMING_AND_CORRECTNESS = """
import os, pytest

@pytest.fixture(scope="module")
def run():
    flag = os.path.join(os.environ["FLAG_DIR"], "ran")
    first = not os.path.exists(flag)
    open(flag, "w").close()
    return {"culprit": 2 if first else 1, "seconds": 9 if first else 1}

def test_the_culprit_is_named(run):
    assert run["culprit"] == 1, "a wrong culprit"

@pytest.mark.timing
def test_named_within_the_bound(run):
    assert run["seconds"] <= 5
"""
THREE_FLAKY = {f"test_flaky{i}.py": FLAKY.replace("ran", f"ran{i}") for i in range(3)}
SLOW_FLAKY = FLAKY.replace("@pytest.mark.timing", "@pytest.mark.timing\n@pytest.mark.slow")


def run(tmp_path: Path, files: dict, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(
        "from timing_rerun import pytest_collectreport, pytest_runtest_logreport, pytest_sessionfinish  # noqa\n"
    )
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = -m 'not slow'\nmarkers =\n    timing: wall-clock\n    slow: slow\n"
    )
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "PARWATCH_TIMING_RERUN"}
    env.update(FLAG_DIR=str(tmp_path), PYTHONPATH=str(TESTS), PARWATCH_RERUN_LOG=str(tmp_path / "reruns.jsonl"))
    # Only the plugins these sessions use (every installed one costs each session and its re-run ~1.4 s of
    # CPU); the re-run inherits the environment and the -p options.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    plugins = ["-p", "pytest_timeout", *(["-p", "xdist.plugin"] if "-n" in args else [])]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *plugins,
            f"--junitxml={tmp_path / 'junit.xml'}",
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def last_line(proc) -> str:
    return proc.stdout.strip().splitlines()[-1]


def reruns(tmp_path: Path) -> list[dict]:
    path = tmp_path / "reruns.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def junit_failures(tmp_path: Path) -> int:
    return sum(int(s.get("failures")) for s in ET.parse(tmp_path / "junit.xml").iter("testsuite"))


def test_a_figure_asserted_without_a_message_is_rerun_too(tmp_path):
    """pytest reports a rewritten assert by its expression, not "AssertionError": the torch pipelining grid's
    replay (0.135 against 0.111 +- 0.02, in a fresh venv on 7d8b47b) failed the session un-re-run."""
    flaky = FLAKY.replace(
        'assert not first, "a host that took the CPU"', "assert {0: 0.1 if first else 0.2} == pytest.approx({0: 0.2})"
    )
    proc = run(tmp_path, {"test_flaky.py": flaky})
    assert proc.returncode == 0 and "timing re-run: passed" in proc.stdout, proc.stdout[-3000:]


def test_a_timing_test_that_passes_its_rerun_passes_everywhere(tmp_path):
    proc = run(tmp_path, {"test_flaky.py": FLAKY})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "timing re-run: passed" in out and "first attempt of test_flaky.py::test_fails_the_first_time" in out
    assert "a host that took the CPU" in out  # the first failure stays in the output
    assert "1 rerun" in last_line(proc) and "failed" not in last_line(proc), last_line(proc)
    assert junit_failures(tmp_path) == 0
    assert [(r["test"], r["rerun"]) for r in reruns(tmp_path)] == [
        ("test_flaky.py::test_fails_the_first_time", "passed")
    ]
    assert "a host that took the CPU" in reruns(tmp_path)[0]["first_failure"]


def test_a_timing_test_failing_twice_fails_and_is_logged(tmp_path):
    proc = run(tmp_path, {"test_slow.py": ALWAYS_FAILS})
    assert proc.returncode == 1 and "timing re-run: failed again" in proc.stdout
    assert "failed" in last_line(proc) and junit_failures(tmp_path) == 1
    assert [r["rerun"] for r in reruns(tmp_path)] == ["failed"]


@pytest.mark.parametrize(
    "files,args,why",
    [
        ({"test_flaky.py": FLAKY, "test_plain.py": PLAIN_FAILURE}, (), "another test failed"),
        ({"test_a_flaky.py": FLAKY, "test_b_plain.py": PLAIN_FAILURE}, ("-x",), "the session stopped early"),
        ({"test_a_flaky.py": FLAKY, "test_b_plain.py": PLAIN_FAILURE}, ("--maxfail=1",), "the session stopped early"),
        ({"test_timeout.py": TIMES_OUT}, (), "a timeout is not a slow host"),
        ({"test_setup.py": SETUP_ERROR}, (), "a setup error is not a figure of time"),
        ({"test_deadline.py": MISSED_DEADLINE}, (), "a missed deadline is a thing that never came"),
        ({"test_key.py": NOT_AN_ASSERTION}, (), "an exception is no figure"),
        ({"test_run.py": TIMING_AND_CORRECTNESS}, (), "a wrong culprit beside a slow figure"),
        (THREE_FLAKY, (), "three timing failures"),
    ],
)
def test_no_second_chance(tmp_path, files, args, why):
    proc = run(tmp_path, files, *args)
    assert proc.returncode == 1, (why, proc.stdout[-2000:])
    assert "running them once more" not in proc.stdout, why
    assert reruns(tmp_path) == [], why
    assert "failed" in last_line(proc) or "error" in last_line(proc), why
    if "-x" in args or "--maxfail=1" in args:
        assert "no timing re-run: the session stopped early" in proc.stdout


def test_two_timing_failures_are_rerun(tmp_path):
    proc = run(tmp_path, {k: v for k, v in list(THREE_FLAKY.items())[:2]})
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert len(reruns(tmp_path)) == 2


def test_a_rerun_under_xdist_runs_alone(tmp_path):
    pytest.importorskip("xdist")
    proc = run(tmp_path, {"test_flaky.py": FLAKY}, "-n", "2")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "timing re-run: passed" in proc.stdout and "1 rerun" in last_line(proc), proc.stdout[-2000:]
    assert [r["rerun"] for r in reruns(tmp_path)] == ["passed"]  # by the controller only, not by the worker too


def test_the_callers_marker_expression_reaches_the_rerun(tmp_path):
    # The ini deselects `slow`; the caller asked for it. A re-run that dropped the caller's -m would
    # deselect the test and fail (no tests ran).
    proc = run(tmp_path, {"test_flaky.py": SLOW_FLAKY}, "-m", "slow")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "timing re-run: passed" in proc.stdout


def test_timing_marks_single_tests_never_a_module():
    """A module-wide mark would give correctness tests of that module (bitwise losses, delivery) a second chance."""
    modules = []
    for path in TESTS.rglob("test_*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
                if "timing" in ast.unparse(node.value):
                    modules.append(path.name)
    assert modules == []


def _assertions(func: ast.FunctionDef) -> int:
    """`assert` statements and assert_*() calls in a test's own body (not in functions nested in it)."""
    count, todo = 0, list(func.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Assert):
            count += 1
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "").startswith("assert_"):
            count += 1
        todo.extend(ast.iter_child_nodes(node))
    return count


def test_a_timing_test_makes_one_assertion():
    """`timing` is for a test whose single assertion is a figure of time: a re-run must never hide a
    correctness assertion beside it (those go in an unmarked test of the same run)."""
    found, checked = {}, 0
    for path in TESTS.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "pytest.mark.timing" in map(ast.unparse, node.decorator_list):
                checked += 1
                if not node.name.startswith("test_") or _assertions(node) != 1:
                    found[f"{path.name}::{node.name}"] = _assertions(node)
    assert found == {} and checked > 10, (found, checked)
