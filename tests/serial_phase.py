"""Two phases in one pytest-xdist session: everything else on every worker, then the serial tests alone.

A test is serial when it is marked `timing` (its assertion is a wall-clock figure), when it shares a
fixture wider than a function with a timing test of its module (that fixture runs the scenario whose
figure is asserted: grouped, it runs once, in the serial phase), or when it is marked `serial` (a
CPU-bound grid that would starve its neighbours). `mark_serial` adds the `serial` marker at
collection, so `-m serial` / `-m "not serial"` select either phase without xdist too.

Under `-n N` the scheduler below (pytest_xdist_make_scheduler) hands out one unit of non-serial tests
at a time and holds every serial unit back until no other worker has a test pending; then one worker
runs the serial units one after another. So no figure is measured while another worker loads the CPU.
The lane tests are held back as well and run beside the serial units on the other workers: the unit
tests (a `unit` folder's files: no servers, no ranks, CPU only) and the tests marked `beside_serial`
(rank runs whose assertions nothing slow can change: losses, orders, exit codes; no sidecar judging
time, no wall-clock figure). The cores are split while they do (pytest_runtest_setup): the serial
worker and every process it started on the first half of this session's CPUs, the lane's workers and
theirs on the rest, so a lane test's imports and page faults never delay a serial rank's wake-up (a
neighbour under SCHED_IDLE did, by 4-11 ms a step: docs/benchmarks.md), and the lane takes its CPU
out of the parallel phase, which is bound by CPU. A unit is a file's tests (as `--dist loadfile`), except in a long
integration or dist file (SPLIT_FILE_SECONDS), whose tests that share no wider fixture are a unit each.
Units go longest first (tests/durations.json, CI's recorded durations: `python -m tests.durations
test-results/junit.xml` refreshes it), so the long ones do not start last and leave the others idle; a
worker still busy with a long unit is given the shortest one to hold behind it (a worker keeps its last
test until it is sent more, so it always holds one). The controller has no items, only node ids: each
worker writes the ids it classified to a file the controller named (pytest_configure_node), and the
scheduler reads it when it starts.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest

LANE = "lane:"
"""The scope prefix of the lane tests' files, which run beside the serial phase on cores of their own."""
SPLIT_KEY = "parwatch_split_cores"
"""The workerinput key telling a worker the cores are split between the serial phase and the lane."""
SERIAL_FILE = "parwatch_serial_ids"
"""The workerinput key naming the file of the node ids classified: {"serial": [...], "alone": [...],
"lane": [...]}."""
DURATIONS = os.environ.get(
    "PARWATCH_TEST_DURATIONS", os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
)
"""{node id: seconds} of the tests that took over a second in a CI run (tests/durations.py)."""
UNKNOWN_SECONDS = 0.2
"""A test the durations do not list: a new one, or one that took under a second."""
SPLIT_FILE_SECONDS = 60.0
"""An integration or dist file longer than this is split: its tests that share no wider fixture run
as units of their own, on whichever worker is free."""
HOLD_BEHIND_SECONDS = 30.0
"""A worker with more than this pending gets the shortest unit to hold, not the longest."""


def mark_serial(config: pytest.Config, items: list[pytest.Item]) -> None:
    timed: set[tuple[str, str]] = set()  # (module file, fixture name) of the timing tests' wider fixtures
    for item in items:
        if "timing" in item.keywords:
            timed |= {(str(item.path), name) for name in _wide_fixtures(item)}
    serial = [
        item
        for item in items
        if "timing" in item.keywords
        or "serial" in item.keywords
        or any((str(item.path), name) in timed for name in _wide_fixtures(item))
    ]
    for item in serial:
        item.add_marker(pytest.mark.serial)
    path = getattr(config, "workerinput", {}).get(SERIAL_FILE)
    if path:  # an xdist worker: tell the controller's scheduler (every worker writes the same lists)
        alone = [
            item.nodeid
            for item in items
            if "/unit/" not in item.nodeid and "serial" not in item.keywords and not _wide_fixtures(item)
        ]
        lane = [item.nodeid for item in items if _lane_item(item)]
        tmp = f"{path}.{config.workerinput['workerid']}"
        with open(tmp, "w") as out:
            json.dump({"serial": [item.nodeid for item in serial], "alone": alone, "lane": lane}, out)
        os.replace(tmp, path)


def _wide_fixtures(item: pytest.Item) -> list[str]:
    """The test's fixtures wider than a function that the project's tests define (a plugin's, such as
    tmp_path_factory, has no base id: it runs no scenario)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [n for n, defs in info.name2fixturedefs.items() if defs and defs[-1].scope != "function" and defs[-1].baseid]


def unit_class(nodeid: str) -> bool:
    """A unit test: its file is in a folder named `unit`."""
    return "unit" in nodeid.split("::", 1)[0].split("/")[:-1]


def _lane_item(item: pytest.Item) -> bool:
    """Runs beside the serial phase: a unit test, or one marked `beside_serial` (not serial)."""
    return "serial" not in item.keywords and (
        unit_class(item.nodeid) or item.get_closest_marker("beside_serial") is not None
    )


def split_cores(cpus: set[int]) -> tuple[set[int], set[int]]:
    """(the serial phase's cores, the lane's): the first half (rounded up) and the rest."""
    ordered = sorted(cpus)
    half = (len(ordered) + 1) // 2
    return set(ordered[:half]), set(ordered[half:])


def pin_with_descendants(cpus: set[int]) -> None:
    """This process, every thread of it, and every process it started before (a fork server, whose later
    ranks inherit it), onto `cpus`."""
    from tests.integration.e2e_util import descendants

    for proc in [os.getpid(), *descendants(os.getpid())]:
        try:
            tasks = [int(t) for t in os.listdir(f"/proc/{proc}/task")]
        except OSError:
            continue  # it ended meanwhile
        for task in tasks:
            try:
                os.sched_setaffinity(task, cpus)
            except OSError:
                pass  # it ended meanwhile


LANE_DONE = ".lane-done"
"""Beside the serial-ids file: written when no lane test is left to run; the serial worker then takes every
core again for the serial units still to come."""
_pinned_to: str | None = None
_CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
"""This worker's cores as it started, before it was pinned to a half."""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """An xdist worker of this scheduler, at its first serial or lane test: it and the processes it started
    move to their half of the cores (the scheduler hands a worker those only once no other worker has
    anything else pending; threads and processes started afterwards inherit it)."""
    global _pinned_to
    workerinput = getattr(item.config, "workerinput", {})
    if not workerinput.get(SPLIT_KEY):
        return
    role = "serial" if "serial" in item.keywords else "lane" if _lane_item(item) else None
    if role == "serial" and os.path.exists(workerinput[SERIAL_FILE] + LANE_DONE):
        role = "alone"  # nothing beside it any more
    if role is None or role == _pinned_to:
        return
    serial_cpus, lane_cpus = split_cores(_CPUS)
    pin_with_descendants({"serial": serial_cpus, "lane": lane_cpus}.get(role, _CPUS))
    _pinned_to = role


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    config = node.config
    if not hasattr(config, "_parwatch_serial_file"):
        handle, config._parwatch_serial_file = tempfile.mkstemp(prefix="parwatch-serial-", suffix=".json")
        os.close(handle)
        config.add_cleanup(lambda: _remove(config._parwatch_serial_file, config._parwatch_serial_file + LANE_DONE))
    node.workerinput[SERIAL_FILE] = config._parwatch_serial_file
    node.workerinput[SPLIT_KEY] = _can_split()


def _remove(*paths: str) -> None:
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


def _can_split() -> bool:
    """Two cores or more, and a kernel that pins (Linux): else there is no lane, its tests run with the others."""
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc") and len(os.sched_getaffinity(0)) >= 2


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return _serial_last_scheduling()(config, log)


def _serial_last_scheduling():
    from xdist.scheduler import LoadScopeScheduling

    class SerialLastScheduling(LoadScopeScheduling):
        """loadfile for the other tests, then the serial units on one worker while the others run the lane."""

        serial: frozenset[str] = frozenset()
        lane: frozenset[str] = frozenset()
        """Tests marked `beside_serial` (not serial): run beside the serial phase, as the unit tests do."""
        alone: frozenset[str] = frozenset()
        """Tests of long files that share no wider fixture: a unit each."""
        seconds: dict[str, float] = {}
        _held = None
        """The node kept for the serial units until the others have nothing pending."""
        _lane_over = False
        """No lane test is left to run (the flag is written): the runner may take every core."""
        _runner = None
        """The node that runs the serial units: the first to ask for work once only they and the lane
        tests are left (it never ran a lane test)."""

        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            if nodeid in self.serial:
                return f"serial:{file}"
            if (unit_class(nodeid) or nodeid in self.lane) and _can_split():
                return f"{LANE}{file}"
            return nodeid if nodeid in self.alone else file

        def schedule(self) -> None:
            if self.collection is None:
                path = getattr(self.config, "_parwatch_serial_file", None)
                if path and os.path.getsize(path):
                    with open(path) as f:
                        ids = json.load(f)
                    self.serial = frozenset(ids["serial"])
                    self.lane = frozenset(ids["lane"])
                    self.seconds = _durations()
                    by_file: dict[str, float] = {}
                    for nodeid in ids["alone"]:
                        file = nodeid.split("::", 1)[0]
                        by_file[file] = by_file.get(file, 0.0) + self.seconds.get(nodeid, UNKNOWN_SECONDS)
                    long = {f for f, total in by_file.items() if total > SPLIT_FILE_SECONDS}
                    self.alone = frozenset(n for n in ids["alone"] if n.split("::", 1)[0] in long)
            super().schedule()

        def _weight(self, unit: dict[str, bool]) -> float:
            """Seconds a unit's tests not yet run are expected to take."""
            return sum(self.seconds.get(n, UNKNOWN_SECONDS) for n, done in unit.items() if not done)

        def _others(self, node) -> list:
            return [n for n in self.assigned_work if n is not node]

        def _busy(self, node) -> bool:
            """`node` has tests pending that are not lane tests (those run beside the serial phase)."""
            return any(
                not done
                for scope, unit in self.assigned_work.get(node, {}).items()
                if not scope.startswith(LANE)
                for done in unit.values()
            )

        def _assign_work_unit(self, node) -> None:
            """The next unit for `node`: the longest left, or the shortest behind a long one. Once only
            serial and lane units are left, the first node to ask runs the serial units: it is held
            (a worker keeps its last test until it is sent more or shut down) until no other node has
            anything but lane tests pending, then runs them one after another. The other nodes take the
            lane tests meanwhile (on the other half of the cores), and are shut down when none are left."""
            queue = list(self.workqueue)
            others = [s for s in queue if not s.startswith(("serial:", LANE))]
            serial = [s for s in queue if s.startswith("serial:")]
            lane = [s for s in queue if s.startswith(LANE)]
            if others:
                held = sum(self._weight(unit) for unit in self.assigned_work.get(node, {}).values())
                pick = min if held > HOLD_BEHIND_SECONDS else max
                scope = pick(others, key=lambda s: self._weight(self.workqueue[s]))
            elif serial and self._runner in (None, node):
                self._runner = node
                if any(self._busy(n) for n in self._others(node)):
                    self._held = node
                    return
                if not self._lane_over and not self._lane_left():
                    self._lane_over = True
                    _lane_done(self.config)  # no lane beside it: the runner keeps every core
                scope = serial[0]
            elif lane:
                scope = max(lane, key=lambda s: self._weight(self.workqueue[s]))
            elif serial:  # nothing for this node but the runner's: it runs what it holds, then leaves
                node.shutdown()
                return
            else:
                scope = queue[0]
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(n) for n, done in work_unit.items() if not done])

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            if not self._lane_over and self._runner is not None and not self._lane_left():
                self._lane_over = True
                _lane_done(self.config)  # the runner takes every core for the serial units still to come

        def _lane_left(self) -> bool:
            """A lane test not yet handed out, or handed out and not yet run."""
            return any(s.startswith(LANE) for s in self.workqueue) or any(
                not done
                for n in self._others(self._runner)
                for scope, unit in self.assigned_work.get(n, {}).items()
                if scope.startswith(LANE)
                for done in unit.values()
            )

        def _reschedule(self, node) -> None:
            super()._reschedule(node)
            held = self._held
            if held is not None and held is not node and held in self.assigned_work and not held.shutting_down:
                if not any(self._busy(n) for n in self._others(held)):
                    self._held = None
                    self._assign_work_unit(held)

    return SerialLastScheduling


def _lane_done(config) -> None:
    path = getattr(config, "_parwatch_serial_file", None)
    if path:
        with open(path + LANE_DONE, "w"):
            pass


def _durations() -> dict[str, float]:
    try:
        with open(DURATIONS) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}  # no record: every unit weighs the same, files go in collection order
