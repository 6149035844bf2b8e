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
