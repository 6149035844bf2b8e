"""Two phases in one pytest-xdist session: everything else on every worker, then the serial tests alone.

A test is serial when it is marked `timing` (its assertion is a wall-clock figure), when it shares a
fixture wider than a function with a timing test of its module (that fixture runs the scenario whose
figure is asserted: grouped, it runs once, in the serial phase), or when it is marked `serial` (a
CPU-bound grid that would starve its neighbours). `mark_serial` adds the `serial` marker at
collection, so `-m serial` / `-m "not serial"` select either phase without xdist too.

Under `-n N` the scheduler below (pytest_xdist_make_scheduler) hands out one unit of non-serial tests
at a time and holds every serial unit back until no other worker has a test pending; then one worker
runs the serial units one after another. So no figure is measured while another worker loads the CPU.
The unit tests (a `unit` folder's files: no servers, no ranks, CPU only) are held back as well and run
beside the serial units on the other workers, under SCHED_IDLE (pytest_runtest_setup): the kernel
runs such a process only on a core nothing else wants and preempts it as soon as anything else
wakes, so they use the cores the serial phase leaves idle (it sleeps in synthetic compute) and take
their 40 s of CPU out of the parallel phase, which is bound by CPU. A unit is a file's tests (as `--dist loadfile`), except in a long
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

IDLE = "idle:"
"""The scope prefix of the unit tests' files, which run beside the serial phase under SCHED_IDLE."""
IDLE_KEY = "parwatch_idle_units"
"""The workerinput key telling a worker its unit tests run under SCHED_IDLE."""
SERIAL_FILE = "parwatch_serial_ids"
"""The workerinput key naming the file of the node ids classified: {"serial": [...], "alone": [...]}."""
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
        tmp = f"{path}.{config.workerinput['workerid']}"
        with open(tmp, "w") as out:
            json.dump({"serial": [item.nodeid for item in serial], "alone": alone}, out)
        os.replace(tmp, path)


def _wide_fixtures(item: pytest.Item) -> list[str]:
    """The test's fixtures wider than a function that the project's tests define (a plugin's, such as
    tmp_path_factory, has no base id: it runs no scenario)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [n for n, defs in info.name2fixturedefs.items() if defs and defs[-1].scope != "function" and defs[-1].baseid]


def idle_class(nodeid: str) -> bool:
    """A unit test: its file is in a folder named `unit`."""
    return "unit" in nodeid.split("::", 1)[0].split("/")[:-1]


_idle_now = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """An xdist worker of this scheduler, at its first unit test: SCHED_IDLE from then on (the scheduler
    hands a worker unit tests only once it has nothing else but them; threads and processes started
    afterwards inherit it)."""
    global _idle_now
    if _idle_now or not getattr(item.config, "workerinput", {}).get(IDLE_KEY) or not idle_class(item.nodeid):
        return
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    _idle_now = True


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    config = node.config
    if not hasattr(config, "_parwatch_serial_file"):
        handle, config._parwatch_serial_file = tempfile.mkstemp(prefix="parwatch-serial-", suffix=".json")
        os.close(handle)
        config.add_cleanup(
            lambda: os.path.exists(config._parwatch_serial_file) and os.remove(config._parwatch_serial_file)
        )
    node.workerinput[SERIAL_FILE] = config._parwatch_serial_file
    node.workerinput[IDLE_KEY] = hasattr(os, "SCHED_IDLE")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return _serial_last_scheduling()(config, log)


def _serial_last_scheduling():
    from xdist.scheduler import LoadScopeScheduling

    class SerialLastScheduling(LoadScopeScheduling):
        """loadfile for the other tests, then the serial units on one worker while the others idle."""

        serial: frozenset[str] = frozenset()
        alone: frozenset[str] = frozenset()
        """Tests of long files that share no wider fixture: a unit each."""
        seconds: dict[str, float] = {}
        _held = None
        """The node kept for the serial units until the others have nothing pending."""
        _runner = None
        """The node that runs the serial units: the first to ask for work once only they and the unit
        tests are left (it never ran a unit test, so it is not under SCHED_IDLE)."""

        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            if nodeid in self.serial:
                return f"serial:{file}"
            if idle_class(nodeid) and hasattr(os, "SCHED_IDLE"):
                return f"{IDLE}{file}"
            return nodeid if nodeid in self.alone else file

        def schedule(self) -> None:
            if self.collection is None:
                path = getattr(self.config, "_parwatch_serial_file", None)
                if path and os.path.getsize(path):
                    with open(path) as f:
                        ids = json.load(f)
                    self.serial = frozenset(ids["serial"])
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
            """`node` has tests pending that are not unit tests (those run under SCHED_IDLE)."""
            return any(
                not done
                for scope, unit in self.assigned_work.get(node, {}).items()
                if not scope.startswith(IDLE)
                for done in unit.values()
            )

        def _assign_work_unit(self, node) -> None:
            """The next unit for `node`: the longest left, or the shortest behind a long one. Once only
            serial and unit-test units are left, the first node to ask runs the serial units: it is held
            (a worker keeps its last test until it is sent more or shut down) until no other node has
            anything but unit tests pending, then runs them one after another. The other nodes take the
            unit tests meanwhile (under SCHED_IDLE), and are shut down when none are left."""
            queue = list(self.workqueue)
            others = [s for s in queue if not s.startswith(("serial:", IDLE))]
            serial = [s for s in queue if s.startswith("serial:")]
            idle = [s for s in queue if s.startswith(IDLE)]
            if others:
                held = sum(self._weight(unit) for unit in self.assigned_work.get(node, {}).values())
                pick = min if held > HOLD_BEHIND_SECONDS else max
                scope = pick(others, key=lambda s: self._weight(self.workqueue[s]))
            elif serial and self._runner in (None, node):
                self._runner = node
                if any(self._busy(n) for n in self._others(node)):
                    self._held = node
                    return
                scope = serial[0]
            elif idle:
                scope = max(idle, key=lambda s: self._weight(self.workqueue[s]))
            elif serial:  # nothing for this node but the runner's: it runs what it holds, then leaves
                node.shutdown()
                return
            else:
                scope = queue[0]
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(n) for n, done in work_unit.items() if not done])

        def _reschedule(self, node) -> None:
            super()._reschedule(node)
            held = self._held
            if held is not None and held is not node and held in self.assigned_work and not held.shutting_down:
                if not any(self._busy(n) for n in self._others(held)):
                    self._held = None
                    self._assign_work_unit(held)

    return SerialLastScheduling


def _durations() -> dict[str, float]:
    try:
        with open(DURATIONS) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}  # no record: every unit weighs the same, files go in collection order
