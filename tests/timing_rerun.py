"""One more run, in a fresh process, for tests whose assertion is a wall-clock figure, and only for them.

This machine's host sometimes takes 20-35% of its CPU for minutes (docs/benchmarks.md), which moves
wall-clock figures (a measured bubble, when a hang is named) but never what a run computes. So a
test marked `timing` (one test, never a module: its assertion is a figure of time) that fails gets
one more run in a fresh process (new fixtures, new measurements), when nothing else failed. Never:
- after `-x`/`--maxfail` stopped the session (tests that never ran could have failed);
- for a timeout (pytest-timeout: a deadlock is not a slow host), nor for a deadline a test waited on
  (tests/deadline.py's DeadlineExceeded: the hang was never named, the server never came up);
- for a failure that is no assertion (a KeyError, pytest.fail): a figure fails an `assert`;
- for a setup or teardown error, or when any other test failed;
- when more than MAX_RERUNS timing tests failed: that many is a regression, not a slow minute.
The re-run gets the caller's options (`-m`, `-k`, `-p`...) with the failed tests' ids in place of
the paths. When it passes, the exit code, the last line ("N passed, 1 rerun") and the JUnit XML all
say so; the first attempt's failure is printed, and every re-run is appended to a JSON-lines log
(PARWATCH_RERUN_LOG, default test-results/timing-reruns.jsonl) that CI prints and keeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

RERUN_ENV = "PARWATCH_TIMING_RERUN"
LOG_ENV = "PARWATCH_RERUN_LOG"
TIMEOUT_MARK = "from pytest-timeout"
DEADLINE_MARK = "DeadlineExceeded"  # tests/deadline.py: the class name is in any traceback that raised it
MAX_RERUNS = 2
"""Timing tests one session may re-run; a third timing failure fails it."""
_first: dict[str, pytest.TestReport] = {}
_other: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed:
        return
    text = report.longreprtext
    crash = getattr(report.longrepr, "reprcrash", None)
    # A rewritten assert's message is the expression ("assert 0.135 == approx(0.111 ± 0.02)"), an assert with a
    # message or a raised one "AssertionError: ...": until 2026-12-06 the first kind, every figure asserted
    # without a message, was taken for no figure and never re-run.
    asserted = crash is not None and crash.message.startswith(("AssertionError", "assert "))
    wall_clock = "timing" in report.keywords and report.when == "call" and asserted
    wall_clock = wall_clock and TIMEOUT_MARK not in text and DEADLINE_MARK not in text
    if wall_clock:
        _first[report.nodeid] = report
    else:
        _other.append(report.nodeid)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _other.append(report.nodeid)


@pytest.hookimpl(trylast=True)  # after junitxml has written its file: a passing re-run corrects it
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: its controller decides
        return
    if os.environ.get(RERUN_ENV) or exitstatus != pytest.ExitCode.TESTS_FAILED or not _first or _other:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter:
        reporter.ensure_newline()
    say = reporter.write_line if reporter else print
    nodeids = sorted(_first)
    if session.shouldfail or session.shouldstop:
        say(
            f"no timing re-run: the session stopped early ({session.shouldfail or session.shouldstop}); "
            "tests after the stop never ran"
        )
        return
    if len(nodeids) > MAX_RERUNS:
        say(f"no timing re-run: {len(nodeids)} timing tests failed, more than {MAX_RERUNS} is not a slow host")
        return
    say(
        f"{len(nodeids)} timing test(s) failed, nothing else: running them once more in a fresh process "
        f"(the host may have taken CPU meanwhile): {', '.join(nodeids)}"
    )
    config = session.config
    serial = ["-n", "0"] if config.pluginmanager.hasplugin("xdist") else []  # alone: no worker beside it
    rerun = subprocess.run(
        [sys.executable, "-m", "pytest", *_caller_options(config), *serial, "-p", "no:cacheprovider", *nodeids],
        cwd=str(config.rootpath),
        env={**os.environ, RERUN_ENV: "1"},
    )
    passed = rerun.returncode == 0
    say(f"timing re-run: {'passed' if passed else 'failed again'}")
    _log(config, nodeids, passed)
    if not passed:
        return
    session.exitstatus = pytest.ExitCode.OK
    if reporter:
        _count_as_rerun(reporter, set(nodeids))
    xmlpath = getattr(config.option, "xmlpath", None)
    if xmlpath and os.path.exists(xmlpath):
        _mark_rerun_in_junit(Path(xmlpath), set(nodeids))


def _caller_options(config: pytest.Config) -> list[str]:
    """The invocation's arguments without its paths (the failed ids replace them) and its JUnit file
    (the first session's file is the one corrected)."""
    paths = set(config.args)
    out: list[str] = []
    args = list(config.invocation_params.args)
    skip_next = False
    for arg in args:
        if skip_next:
            skip_next = False
        elif arg in ("--junitxml", "--junit-xml"):
            skip_next = True
        elif arg.startswith(("--junitxml=", "--junit-xml=")) or arg in paths:
            continue
        else:
            out.append(arg)
    return out


def _count_as_rerun(reporter, nodeids: set[str]) -> None:
    """The first failures leave the failed count for `rerun` (the last line then agrees with the
    exit code); their tracebacks are printed here, since the failure section no longer shows them."""
    failed = reporter.stats.get("failed", [])
    first = [r for r in failed if r.nodeid in nodeids]
    reporter.stats["failed"] = [r for r in failed if r.nodeid not in nodeids]
    if not reporter.stats["failed"]:
        del reporter.stats["failed"]
    reporter.stats.setdefault("rerun", []).extend(first)
    for report in first:
        reporter.write_sep("_", f"first attempt of {report.nodeid} (passed when re-run)")
        reporter.write_line(report.longreprtext)
    reporter._main_color = None  # recomputed from the corrected counts


def _junit_address(nodeid: str) -> tuple[str, str]:
    """(classname, name) as pytest's junitxml writes a test id."""
    path, *names = nodeid.split("::")
    module = path[:-3] if path.endswith(".py") else path
    return ".".join([module.replace("/", "."), *names[:-1]]), names[-1]


def _mark_rerun_in_junit(path: Path, nodeids: set[str]) -> None:
    tree = ET.parse(path)
    wanted = {_junit_address(n) for n in nodeids}
    for suite in tree.iter("testsuite"):
        for case in suite.iter("testcase"):
            if (case.get("classname"), case.get("name")) not in wanted:
                continue
            for failure in case.findall("failure"):
                case.remove(failure)
                suite.set("failures", str(int(suite.get("failures", "1")) - 1))
            props = case.find("properties")
            if props is None:
                props = ET.SubElement(case, "properties")
            ET.SubElement(props, "property", name="timing_rerun", value="failed, then passed in a fresh process")
    tree.write(path, encoding="utf-8", xml_declaration=True)


def _log(config: pytest.Config, nodeids: list[str], passed: bool) -> None:
    path = Path(os.environ.get(LOG_ENV) or config.rootpath / "test-results" / "timing-reruns.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        for nodeid in nodeids:
            crash = getattr(_first[nodeid].longrepr, "reprcrash", None)
            message = crash.message if crash else _first[nodeid].longreprtext
            out.write(
                json.dumps(
                    {
                        "time": round(time.time(), 3),
                        "test": nodeid,
                        "rerun": "passed" if passed else "failed",
                        "first_failure": message[:500],
                    }
                )
                + "\n"
            )
