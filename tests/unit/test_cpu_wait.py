"""A rank's wait for a CPU since its boundary (sidecar/cpu_wait.py), read from the kernel by its node, and
the leader judging a stall without it: a starved host's slow steps are no hang; a rank hung on one is still
named, by 4x the bound at the latest (sidecar/hang.py, MAX_STARVED_SHARE)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from msgspec.structs import replace

from parwatch.rank_layout import RankLayout
from parwatch.sidecar.cpu_wait import CpuWaits, run_queue_wait
from parwatch.sidecar.digest import NodeBook
from parwatch.sidecar.hang import MAX_STARVED_SHARE
from tests.starving import on_one_core, spinning
from tests.unit.test_hang_analysis import _stalled_monitor, act


class Reads:
    """A process's summed wait as a test sets it, and a clock."""

    def __init__(self):
        self.t, self.waited = 100.0, {}

    def clock(self) -> float:
        return self.t

    def read(self, pid: int) -> float | None:
        return self.waited.get(pid)


def _row(pid=7, step_end=None, since=None, host="h0"):
    return replace(act(0, RankLayout(1, 1, 1), host=host, since=since), pid=pid, step_end=step_end)


def test_the_wait_since_a_boundary_is_placed_between_the_samples_around_it():
    reads = Reads()
    waits = CpuWaits(reads.clock, reads.read)
    assert waits.waited(_row(step_end=100.5)) is None  # asked: sampled from the next tick on
    for t, waited in ((101.0, 1.0), (102.0, 1.5), (103.0, 2.5)):
        reads.t, reads.waited[7] = t, waited
        waits.sample()
    assert waits.waited(_row(step_end=102.5)) == pytest.approx((0.5, 0.5))  # half of 1.5 -> 2.5
    assert waits.waited(_row(step_end=103.5)) == (0.0, 0.0)  # after the newest sample: nothing known yet
    assert waits.waited(_row(step_end=90.0)) == pytest.approx((1.5, 1.5))  # before the oldest: from it (less)
    assert waits.waited(_row(step_end=None)) == pytest.approx((1.5, 1.5))  # no boundary yet: the same
    assert waits.waited(_row(pid=8, step_end=102.5)) is None  # another process (a restart): its own
    # In a span it entered after its boundary: since then too (what it waited before is no part of that span).
    assert waits.waited(_row(step_end=101.5, since=102.5)) == pytest.approx((1.25, 0.5))
    assert waits.waited(_row(step_end=102.5, since=90.0)) == pytest.approx((0.5, 0.5))  # a span open across it


def test_the_wait_per_second_lately_is_read_over_the_asked_span_and_at_least_the_newest_two_samples():
    reads = Reads()
    waits = CpuWaits(reads.clock, reads.read)
    assert waits.per_second(7, 5.0) is None  # asked: sampled from the next tick on
    for t, waited in ((101.0, 1.0), (102.0, 1.2), (103.0, 2.2), (104.0, 3.2)):
        reads.t, reads.waited[7] = t, waited
        waits.sample()
        if t == 101.0:
            assert waits.per_second(7, 5.0) is None  # one sample: no rate yet
    assert waits.per_second(7, 2.0) == pytest.approx(1.0)  # 102 -> 104: a second a second
    assert waits.per_second(7, 0.5) == pytest.approx(1.0)  # shorter than the newest two: over them
    assert waits.per_second(7, 2.5) == pytest.approx((3.2 - 1.1) / 2.5)  # from between the samples around 101.5
    assert waits.per_second(7, 60.0) == pytest.approx(2.2 / 3.0)  # nothing older than the oldest sample: from it


def test_a_process_that_cannot_be_read_is_no_longer_sampled_and_another_run_starts_afresh():
    reads = Reads()
    waits = CpuWaits(reads.clock, reads.read)
    waits.waited(_row(pid=7))
    reads.waited[7] = 3.0
    waits.sample()
    assert waits.waited(_row(pid=7, step_end=90.0)) == (0.0, 0.0)
    del reads.waited[7]  # it ended
    waits.sample()
    assert waits.waited(_row(pid=7, step_end=90.0)) is None
    reads.waited[7] = 4.0
    waits.sample()
    waits.forget()
    waits.sample()
    assert waits.waited(_row(pid=7, step_end=90.0)) is None


def test_a_nodes_rows_carry_the_wait_of_its_own_live_ranks_only():
    reads = Reads()
    alive = {1000, 1001}
    book = NodeBook(reads.clock, hostname="h0", alive=alive.__contains__, cpu_waits=CpuWaits(reads.clock, reads.read))
    lay = RankLayout(1, 3, 1)
    for r, host in ((0, "h0"), (1, "h0"), (2, "h1")):
        book.add(act(r, lay, host=host, time=reads.t), lay, "run")
    book.rows()  # asked
    reads.waited = {1000: 2.0, 1001: 2.0, 1002: 2.0}
    book.cpu_waits.sample()
    alive.discard(1001)  # rank 1's process ended
    rows = book.rows()
    assert (rows[0].cpu_wait, rows[0].span_cpu_wait) == (0.0, 0.0)
    assert rows[1].state == "gone" and rows[1].cpu_wait is None
    assert rows[2].cpu_wait is None  # another host's pid is not this node's to read


@pytest.mark.serial  # busy loops on a core: not beside the serial figures (tests/integration/test_starved_host.py)
@pytest.mark.skipif(run_queue_wait(os.getpid()) is None, reason="this kernel does not count run-queue waits")
def test_the_kernel_counts_a_starved_process_wait_and_not_a_blocked_ones():
    """On one core beside three busy loops (each in a session of its own: autogroup scheduling shares a core
    between sessions), a process that wants the CPU waits for it most of the time; one blocked in a sleep
    does not, and its parwatch thread (named parwatch-*) that wakes every 10 ms is not counted."""
    core = max(os.sched_getaffinity(0))
    code = "import os, sys, time; os.sched_setaffinity(0, {%d}); %s; sys.stdout.write('go\\n'); sys.stdout.flush(); %s"
    own = "from parwatch.thread_names import daemon_thread; daemon_thread(lambda: [time.sleep(0.01) for _ in iter(int, 1)], 'parwatch-test').start()"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    busy = subprocess.Popen(
        [sys.executable, "-c", code % (core, "pass", "t = time.time()\nwhile time.time() - t < 30: pass")],
        stdout=subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    asleep = subprocess.Popen(
        [sys.executable, "-c", code % (core, own, "time.sleep(30)")], stdout=subprocess.PIPE, start_new_session=True, env=env,
    )  # fmt: skip
    try:
        assert busy.stdout.readline() == b"go\n" and asleep.stdout.readline() == b"go\n"
        before = {p.pid: run_queue_wait(p.pid) for p in (busy, asleep)}
        with on_one_core(), spinning(3):
            time.sleep(1.0)
            waited = {p.pid: run_queue_wait(p.pid) - before[p.pid] for p in (busy, asleep)}
        names = {(Path(t) / "comm").read_text().strip() for t in Path(f"/proc/{asleep.pid}/task").iterdir()}
    finally:
        for p in (busy, asleep):
            p.kill()
            p.wait()
    assert "parwatch-test" in names, names  # named for the OS
    assert waited[busy.pid] > 0.4, waited  # ~3/4 of the second with three busy neighbours
    assert waited[asleep.pid] < 0.01, waited


# -- the leader's judgement -------------------------------------------------------------------------


def _waited(rows, rank, seconds, in_span=None):
    """The rank's wait since its boundary and since it entered its span (the same unless given)."""
    rows[rank] = replace(rows[rank], cpu_wait=seconds, span_cpu_wait=seconds if in_span is None else in_span)


def test_a_stall_the_culprit_spent_waiting_for_a_cpu_is_no_hang_until_the_rest_passes_the_bound():
    monitor, clock, engine, rows, boundary = _stalled_monitor(0.0)
    clock.t = boundary + 12.0  # past the 10 s bound ...
    _waited(rows, 1, 4.0)  # ... but rank 1 (the culprit) waited 4 s of it for a CPU: 8 s judged
    assert monitor.due(gone_hint=False) and monitor.check(rows) == []
    assert monitor.seconds_until_due() == pytest.approx(2.0)  # asked again when the rest reaches the bound
    clock.t = boundary + 14.0
    _waited(rows, 1, 4.0)  # it runs now (no more waiting): 10 s judged
    [record] = monitor.check(rows)
    evidence = record["evidence"]
    assert evidence["culprit"]["rank"] == 1 and evidence["cpu_wait_seconds"] == 4.0
    assert evidence["stalled_seconds"] == pytest.approx(14.0)
    assert "4.00 s of it waiting for a CPU, not counted" in record["reason"]


def test_a_rank_hung_while_always_waiting_for_a_cpu_is_named_at_four_times_the_bound():
    """A rank spinning in its hang on a starved host waits for a CPU all along: at most MAX_STARVED_SHARE of
    the stall is put down to it (a node's token holder cannot hold a hang back longer either)."""
    monitor, clock, engine, rows, boundary = _stalled_monitor(0.0)
    latest = 10.0 / (1 - MAX_STARVED_SHARE)
    assert latest == 40.0
    clock.t = boundary + latest - 0.01
    _waited(rows, 1, latest)
    assert monitor.check(rows) == []
    clock.t = boundary + latest
    [record] = monitor.check(rows)
    assert record["evidence"]["cpu_wait_seconds"] == pytest.approx(MAX_STARVED_SHARE * latest)


def test_a_blocked_culprit_on_a_starved_host_is_named_at_the_bound():
    """Its peers wait for a CPU (they run between their waits); the culprit, blocked, does not: its own wait
    judges it, since it entered its span (what it waited before it blocked there is no part of the stall)."""
    monitor, clock, engine, rows, boundary = _stalled_monitor(0.0)
    clock.t = boundary + 10.0
    _waited(rows, 0, 6.0)
    _waited(rows, 1, 3.0, in_span=0.0)
    [record] = monitor.check(rows)
    assert record["evidence"]["culprit"]["rank"] == 1 and record["evidence"]["cpu_wait_seconds"] == 0.0


def test_a_transport_stalls_other_end_waiting_for_a_cpu_counts():
    """Rank 1's send is not taken while rank 0 waits in the matching receive: a transport stall, rank 1
    named. The bytes flow only as both ends run: the receiver's wait for a CPU counts too."""
    monitor, clock, engine, rows, boundary = _stalled_monitor(0.0)
    lay = monitor.layout
    rows[0] = replace(act(0, lay, "recv", "recv", "pp", peer=1, since=boundary + 0.01, time=clock.t), step=5)
    rows[1] = replace(act(1, lay, "send", "send", "pp", peer=0, since=boundary + 0.01, time=clock.t), step=5)
    clock.t = boundary + 12.0
    _waited(rows, 0, 5.0)
    _waited(rows, 1, 0.0)
    found = monitor.survey(rows).whole().culprit(lay, None)
    assert (found["kind"], found["culprit"], found["kind_waits_on"]) == ("transport", 1, [0])
    assert monitor.check(rows) == []
    clock.t = boundary + 15.0
    [record] = monitor.check(rows)
    assert record["evidence"]["cpu_wait_seconds"] == pytest.approx(5.0)
