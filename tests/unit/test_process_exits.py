"""ProcessExits on real processes: each exit stamped in the order it happened, and a node's rows carry
the stamp (parwatch/sidecar/exits.py, digest.NodeBook)."""

import os
import subprocess
import sys
import time

import pytest

from parwatch.rank_layout import RankLayout
from parwatch.sidecar.digest import NodeBook
from parwatch.sidecar.exits import ProcessExits
from parwatch.wire.activity import Activity

pytestmark = pytest.mark.skipif(ProcessExits()._epoll is None, reason="needs pidfd_open (Linux >= 5.3)")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "not within 10 s"
        time.sleep(0.01)


@pytest.fixture
def exits():
    watch = ProcessExits()
    yield watch
    watch.close()


@pytest.fixture
def sleepers():
    procs = [subprocess.Popen(SLEEPER) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_each_exit_is_stamped_in_the_order_the_processes_ended(exits, sleepers):
    first, second = sleepers
    for p in sleepers:
        exits.watch(p.pid)
    assert exits.ended(first.pid) is None and exits.ended(second.pid) is None
    first.kill()
    first.wait()
    wait_for(lambda: exits.ended(first.pid) is not None)
    time.sleep(0.3)  # the second ends well after: its stamp must come after the first's
    before = time.time()
    second.kill()
    second.wait()
    wait_for(lambda: exits.ended(second.pid) is not None)
    assert exits.ended(first.pid) < before <= exits.ended(second.pid)


def test_exits_read_at_one_clock_reading_keep_the_order_they_ended_in(sleepers):
    """A thread woken late (the clock reads the same for both) still stamps the first to end first."""
    exits = ProcessExits(clock=lambda: 100.0)
    try:
        first, second = sleepers
        for p in sleepers:
            exits.watch(p.pid)
        for p in (first, second):  # each ended (a zombie, not reaped) before the next is killed
            p.kill()
            os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
        wait_for(lambda: exits.ended(second.pid) is not None)
        assert 100.0 <= exits.ended(first.pid) < exits.ended(second.pid)
    finally:
        exits.close()


def test_a_process_already_gone_is_not_stamped_and_drop_forgets(exits, sleepers):
    first, second = sleepers
    first.kill()
    first.wait()
    exits.watch(first.pid)  # gone before it was watched: no exact time to claim
    exits.watch(second.pid)
    second.kill()
    second.wait()
    wait_for(lambda: exits.ended(second.pid) is not None)
    assert exits.ended(first.pid) is None
    exits.drop(second.pid)
    assert exits.ended(second.pid) is None


def test_close_ends_the_thread_and_watching_stops(sleepers):
    watch = ProcessExits()
    watch.watch(sleepers[0].pid)
    thread = watch._thread
    watch.close()
    assert thread is not None and not thread.is_alive()
    watch.watch(sleepers[1].pid)  # after close: a no-op, no error
    assert watch.ended(sleepers[1].pid) is None


def _row(rank: int, pid: int, layout: RankLayout) -> Activity:
    return Activity(rank, "running", "forward", None, None, None, None, 1.0, 3, 0.1, pid, "h0", rank, 0, 0, 5.0, None)


def test_the_node_book_reads_a_stamped_rank_as_gone_with_its_end(exits, sleepers):
    """Even where the pid check would say alive (a reused pid), the stamp says the process ended."""
    book = NodeBook(time.time, silent_seconds=60.0, hostname="h0", alive=lambda pid: True, exits=exits)
    lay = RankLayout(1, 2, 1)
    for rank, p in enumerate(sleepers):
        book.add(_row(rank, p.pid, lay), lay, "run")
    sleepers[1].kill()
    sleepers[1].wait()
    wait_for(lambda: exits.ended(sleepers[1].pid) is not None)
    rows = book.rows()
    assert (rows[0].state, rows[0].ended) == ("running", None)
    assert (rows[1].state, rows[1].ended) == ("gone", exits.ended(sleepers[1].pid))
    book.add(_row(1, sleepers[0].pid + 100_000, lay), lay, "run")  # rank 1 restarted as another pid
    assert exits.ended(sleepers[1].pid) is None
    book.add(_row(0, sleepers[0].pid, lay), lay, "next-run")  # a new run forgets the old processes
    assert exits._fd_of == {sleepers[0].pid: exits._fd_of[sleepers[0].pid]}
