"""The rank's ordered shutdown and the launcher's account of how a rank ended (issue 26)."""

from __future__ import annotations

import multiprocessing

import pytest

from parwatch.trainer import launch
from parwatch.trainer.progress import RankProgress, describe_exit, exit_status


class _Recorder:
    def __init__(self, calls: list, name: str, fail: bool = False):
        self.calls, self.name, self.fail = calls, name, fail

    def close(self, *args, **kwargs):
        self.calls.append((self.name, args))
        if self.fail:
            raise RuntimeError(f"{self.name} broke")


def _patch_dist(monkeypatch, calls):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append(("destroy", ())))


def test_shutdown_order_trainer_then_observer_then_group(monkeypatch):
    calls: list = []
    _patch_dist(monkeypatch, calls)
    launch.shutdown(_Recorder(calls, "trainer"), _Recorder(calls, "observer"), failed=False)
    assert [name for name, _ in calls] == ["trainer", "observer", "destroy"]
    assert calls[0][1] == (False,)


def test_shutdown_runs_every_step_when_one_fails(monkeypatch):
    calls: list = []
    _patch_dist(monkeypatch, calls)
    with pytest.raises(RuntimeError, match="trainer broke"):
        launch.shutdown(_Recorder(calls, "trainer", fail=True), _Recorder(calls, "observer"), failed=False)
    assert [name for name, _ in calls] == ["trainer", "observer", "destroy"]
    # After a failure the first error (the training one) is what propagates: shutdown's is only logged.
    calls.clear()
    launch.shutdown(_Recorder(calls, "trainer", fail=True), None, failed=True)
    assert [name for name, _ in calls] == ["trainer", "destroy"]
    assert calls[0][1] == (True,)


def _progress(phase_steps):
    shared = RankProgress.shared_array(multiprocessing.get_context("spawn"), len(phase_steps))
    for rank, (phase, step) in enumerate(phase_steps):
        p = RankProgress(shared, rank)
        if phase != "starting":
            p.training()
            p.step(step)
        if phase == "teardown":
            p.teardown()
    return shared


def test_describe_exit_names_rank_signal_phase_and_step():
    shared = _progress([("training", 3), ("teardown", 6), ("starting", 0)])
    assert describe_exit(shared, 0, 3, 6) == "rank 0 exited with code 3 while training, after step 3 of 6"
    assert describe_exit(shared, 1, -6, 6) == "rank 1 was killed by SIGABRT during teardown, after step 6 of 6"
    assert describe_exit(shared, 2, 2, 6) == "rank 2 exited with code 2 while starting"


def test_exit_status_is_the_shells():
    assert exit_status(-6) == 134
    assert exit_status(-9) == 137
    assert exit_status(3) == 3
