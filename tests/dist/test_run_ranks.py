"""run_ranks forks its ranks from a fork server started once per session: each rank still sees the
caller's environment and directory as they are at the call, as a spawned process would."""

from __future__ import annotations

import os

from tests.distutil import run_ranks


def _where(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    return os.environ.get("PARWATCH_RUN_RANKS_PROBE"), os.getcwd(), dist.get_rank(), os.getpid()


def test_ranks_see_the_callers_environment_and_directory_at_each_call(tmp_path, monkeypatch):
    run_ranks(_where, 2)  # the fork server may start here, before what follows changes
    monkeypatch.setenv("PARWATCH_RUN_RANKS_PROBE", "first")
    monkeypatch.chdir(tmp_path)
    first = run_ranks(_where, 2)
    monkeypatch.setenv("PARWATCH_RUN_RANKS_PROBE", "second")
    second = run_ranks(_where, 2)
    assert [r[:3] for r in first] == [("first", str(tmp_path), 0), ("first", str(tmp_path), 1)]
    assert [r[:3] for r in second] == [("second", str(tmp_path), 0), ("second", str(tmp_path), 1)]
    assert len({r[3] for r in first + second}) == 4  # a new process for every rank of every call


def _fails(rank: int, world: int) -> None:
    raise AssertionError(f"rank {rank}'s own failure")


def test_a_rendezvous_on_a_taken_port_is_tried_once_more_and_fns_failures_never(monkeypatch):
    """A port another process holds (as another worker's ranks may, picked in the same moment) fails the
    rendezvous before fn runs: the ranks start again on another port. What fn raises is not retried."""
    import socket

    import tests.distutil as distutil

    real_free_port = distutil.free_port
    taken = socket.create_server(("127.0.0.1", 0))
    ports = iter([taken.getsockname()[1], real_free_port()])
    with taken:
        monkeypatch.setattr(distutil, "free_port", lambda: next(ports))
        assert [r[2] for r in run_ranks(_where, 2, timeout=60)] == [0, 1]
    calls = []
    monkeypatch.setattr(distutil, "free_port", lambda: calls.append(1) or real_free_port())
    try:
        run_ranks(_fails, 2, timeout=60)
    except AssertionError as err:
        assert "own failure" in str(err) and len(calls) == 1
    else:
        raise AssertionError("fn's failure was not raised")
