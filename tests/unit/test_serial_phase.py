"""tests/serial_phase.py on small sessions of its own: under pytest-xdist the serial tests (timing, those
sharing a timing test's scenario fixture, `serial`) run after every other test, alone; without xdist
`-m serial` selects them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent

RECORD = """
import json, os, time, pytest

def record(name):
    start = time.monotonic()
    time.sleep(0.4)
    with open(os.path.join(os.environ["OUT"], name + ".json"), "w") as f:
        json.dump([start, time.monotonic(), os.environ.get("PYTEST_XDIST_WORKER", ""), sorted(os.sched_getaffinity(0))], f)
"""
PLAIN = RECORD + "".join(f"\ndef test_{i}():\n    record(__name__ + '{i}')\n" for i in range(3))
SCENARIO = (
    RECORD
    + """
@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    return tmp_path_factory.mktemp("scenario")

@pytest.mark.timing
def test_figure(scenario):
    record("figure")

def test_correctness_of_the_same_run(scenario):
    record("same_run")

def test_unrelated(tmp_path):  # tmp_path_factory behind it is session-wide, and no scenario
    record("unrelated")
"""
)
GRID = RECORD + "\npytestmark = pytest.mark.serial\n\ndef test_grid():\n    record('grid')\n"
SERIAL = {"figure", "same_run", "grid"}


CPUS = {0, 1}
"""The cores the small sessions run on (their workers split them), whatever half this test runs on."""


def every_core() -> None:
    """The session on two cores, though this test may run pinned to half of them (the suite's own unit
    tests do, beside its serial phase)."""
    os.sched_setaffinity(0, CPUS)


def run(tmp_path: Path, *args: str, files: dict[str, str] | None = None, env: dict | None = None):
    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "from serial_phase import mark_serial, pytest_configure_node, pytest_runtest_setup  # noqa\n"
        "from serial_phase import pytest_xdist_make_scheduler  # noqa\n\n"
        "@pytest.hookimpl(tryfirst=True)\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    mark_serial(config, items)\n"
    )
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    timing: wall-clock\n    serial: alone\n    beside_serial: the lane\n"
    )
    files = files or {"test_a.py": PLAIN, "test_b.py": PLAIN, "test_c.py": SCENARIO, "test_d.py": GRID}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": f"{TESTS}{os.pathsep}{TESTS.parent}", **(env or {})}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # xdist alone: the installed plugins cost each worker ~1.4 s CPU
    plugins = ["-p", "xdist.plugin"] if "-n" in args else []
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=every_core,
    )


def intervals(tmp_path: Path) -> dict[str, list]:
    return {p.stem: json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")}


def test_serial_tests_run_last_and_alone_under_xdist(tmp_path):
    pytest.importorskip("xdist")
    proc = run(tmp_path, "-n", "2")
    assert proc.returncode == 0, proc.stdout[-3000:]
    ran = intervals(tmp_path)
    assert len(ran) == 10, sorted(ran)
    serial = {k: v for k, v in ran.items() if k in SERIAL}
    others = {k: v for k, v in ran.items() if k not in SERIAL}
    assert len({worker for _, _, worker, _ in ran.values()}) == 2  # the others did run in parallel
    last_other = max(end for _, end, _, _ in others.values())
    assert all(start >= last_other for start, _, _, _ in serial.values()), (serial, others)
    spans = sorted((start, end) for start, end, _, _ in serial.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # one after another


def test_minus_m_serial_selects_them_without_xdist(tmp_path):
    proc = run(tmp_path, "-m", "serial")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert set(intervals(tmp_path)) == SERIAL


def test_the_longest_unit_starts_first(tmp_path):
    """By the recorded durations: the one-test file (40 s recorded) is handed out first, though xdist's own
    order (most tests first) would hand it out last. (Which worker runs which of a long file's tests depends
    on when each finishes: not asserted.)"""
    pytest.importorskip("xdist")
    files = {"test_a.py": PLAIN, "test_b.py": PLAIN, "test_one.py": RECORD + "\ndef test_x():\n    record('one')\n"}
    (tmp_path / "durations.json").write_text(json.dumps({"test_one.py::test_x": 40.0}))
    proc = run(tmp_path, "-n", "2", files=files, env={"PARWATCH_TEST_DURATIONS": str(tmp_path / "durations.json")})
    assert proc.returncode == 0, proc.stdout[-3000:]
    ran = intervals(tmp_path)
    worker = ran["one"][2]  # handed out first: its worker ran nothing before it
    assert all(start >= ran["one"][0] for start, _, w, _ in ran.values() if w == worker), sorted(ran.items())


UNIT = RECORD + "".join(f"\ndef test_{i}():\n    record('unit{i}')\n" for i in range(4))
MARKED = (
    RECORD
    + "\npytestmark = pytest.mark.beside_serial\n"
    + "".join(f"\ndef test_{i}():\n    record('unitlike{i}')\n" for i in range(2))
)


def test_the_lane_runs_beside_the_serial_phase_on_the_other_half_of_the_cores(tmp_path):
    """The unit tests, and tests marked `beside_serial`, wait for the other tests to be handed out, then run
    on the workers the serial phase leaves free, pinned to the second core while the serial tests run pinned
    to the first; every other test on both."""
    pytest.importorskip("xdist")
    if len(os.sched_getaffinity(0) | CPUS) < 2 or not CPUS <= set(range(os.cpu_count() or 1)):
        pytest.skip("needs cores 0 and 1")
    files = {"test_a.py": PLAIN, "test_c.py": SCENARIO, "test_d.py": GRID, "unit/test_u.py": UNIT}
    grid2 = GRID.replace("record('grid')", "record('grid2')")  # the last serial test, after the lane is over
    proc = run(tmp_path, "-n", "3", files={**files, "test_i.py": MARKED, "test_j.py": grid2})
    assert proc.returncode == 0, proc.stdout[-3000:]
    ran = intervals(tmp_path)
    lane = {k: v for k, v in ran.items() if k.startswith("unit")}
    serial = {k: v for k, v in ran.items() if k in SERIAL | {"grid2"}}
    others = {k: v for k, v in ran.items() if k not in lane and k not in serial}
    assert len(lane) == 6 and len(serial) == 4 and len(others) == 4, sorted(ran)
    assert {tuple(cpus) for *_, cpus in lane.values()} == {(1,)}
    assert {tuple(cpus) for *_, cpus in others.values()} == {(0, 1)}
    # The serial tests on the first core while the lane lasts; once it is over (its last report in: a moment
    # after its last test's end), on both.
    last_lane = max(end for _, end, _, _ in lane.values())
    assert all(cpus == [0] for start, _, _, cpus in serial.values() if start < last_lane), ran
    assert all(cpus == [0, 1] for start, _, _, cpus in serial.values() if start > last_lane + 0.2), ran
    assert max(start for start, *_ in serial.values()) > last_lane + 0.2, ran  # so one did start after it
    last_other = max(end for _, end, _, _ in others.values())
    assert all(start >= last_other for start, *_ in serial.values()), (serial, others)
    serial_workers = {worker for _, _, worker, _ in serial.values()}
    assert len(serial_workers) == 1 and not serial_workers & {worker for _, _, worker, _ in lane.values()}
    first_serial, last_serial = min(v[0] for v in serial.values()), max(v[1] for v in serial.values())
    assert any(start < last_serial and end > first_serial for start, end, *_ in lane.values()), (lane, serial)


def test_a_worker_pinned_takes_the_processes_it_started_with_it(tmp_path):
    """A fork server started in the parallel phase forks the ranks of a later lane or serial test: it moves to
    its worker's half of the cores, or those ranks would run on the other half."""
    code = (
        "import os, subprocess, sys, time\n"
        "from serial_phase import pin_with_descendants\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import subprocess, sys; "
        'subprocess.run([sys.executable, "-c", "import time; time.sleep(30)"])\'])\n'
        "time.sleep(1.0)\n"
        "pin_with_descendants({1})\n"
        "kids = [int(p) for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/stat').read()"
        ".rpartition(')')[2].split()[1] == str(child.pid)]\n"
        "print(sorted(os.sched_getaffinity(child.pid)), [sorted(os.sched_getaffinity(k)) for k in kids], "
        "sorted(os.sched_getaffinity(0)))\n"
        "child.kill()\n"
        "for k in kids: os.kill(k, 9)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{TESTS.parent}"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, preexec_fn=every_core
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[1]", "[[1]]", "[1]"], proc.stdout


def test_the_cores_split_in_halves_the_serial_phase_taking_the_odd_one():
    from serial_phase import split_cores

    assert split_cores({0, 1}) == ({0}, {1})
    assert split_cores({4, 5, 6}) == ({4, 5}, {6})
    assert split_cores({3}) == ({3}, set())
