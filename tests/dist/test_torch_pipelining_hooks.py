"""The integration's hooks on a one-rank pipeline: what it shadows, what it restores, and the
error when the installed torch lacks the private functions the send/recv spans hook."""

from __future__ import annotations

import pytest

from tests.distutil import run_ranks

pytestmark = [pytest.mark.beside_serial, pytest.mark.dist, pytest.mark.timeout(120)]


def hooks_body(rank: int, world_size: int) -> dict:
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, schedules

    from parwatch.contract import registry
    from parwatch.integrations import _p2p
    from parwatch.integrations.torch_pipelining import P2PHookMissing, PipelineWatch, schedule_name

    class Recorder:
        boundary_slots = 0

        def __init__(self):
            self.spans = []

        def on_span(self, span):
            self.spans.append((str(span.kind), dict(span.attrs)))

        def fill_boundary(self, step, slots):
            pass

        def pending_directive(self):
            return None

        def on_boundary(self, info, slots):
            pass

        def on_event(self, name, attrs):
            pass

    class MySchedule(ScheduleGPipe):  # a user's subclass keeps its torch base's name
        pass

    stage = PipelineStage(torch.nn.Linear(4, 4), 0, 1, torch.device("cpu"))
    schedule = MySchedule(stage, 2, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    out = {"name": schedule_name(schedule)}
    original = (schedules._batch_p2p, schedules._wait_batch_p2p)

    # 1. the private functions missing: a clear error, and nothing left patched
    saved = schedules._batch_p2p
    del schedules._batch_p2p
    try:
        PipelineWatch(schedule, run_id="hooks")
    except P2PHookMissing as exc:
        out["missing_error"] = str(exc)
    finally:
        schedules._batch_p2p = saved
    out["clean_after_error"] = not any(k in stage.__dict__ for k in ("forward_one_chunk", "get_fwd_send_ops"))

    # 2. attached: spans with stage/chunk/microbatch, loss and grad scaling; detached: all restored
    recorder = Recorder()
    registry.register(recorder)
    watch = PipelineWatch(schedule, run_id="hooks")
    out["patched"] = schedules._batch_p2p is not original[0] and "forward_one_chunk" in stage.__dict__
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    schedule.step(x, target=y)
    watch.detach()
    registry.unregister(recorder)
    out["spans"] = recorder.spans
    out["restored"] = (
        (schedules._batch_p2p, schedules._wait_batch_p2p) == original
        and not any(
            k in stage.__dict__
            for k in ("forward_one_chunk", "backward_one_chunk", "perform_reduce_grad", "get_fwd_recv_ops")
        )
        and "_maybe_compute_loss" not in schedule.__dict__
    )
    out["users"] = _p2p._users
    return out


def test_hooks_shadow_instances_and_restore_them():
    out = run_ranks(hooks_body, 1, timeout=100)[0]
    assert out["name"] == "gpipe"
    assert "_batch_p2p" in out["missing_error"] and "p2p=False" in out["missing_error"]
    assert out["clean_after_error"] and out["patched"] and out["restored"] and out["users"] == 0
    kinds = [k for k, _ in out["spans"]]
    assert kinds.count("forward") == 2 and kinds.count("backward") == 2 and kinds.count("loss") == 2
    assert kinds.count("dp_sync") == 1  # gradient scaling after the last backward
    forward = [a for k, a in out["spans"] if k == "forward"]
    assert [a["microbatch"] for a in forward] == [0, 1]
    assert all(a["stage"] == 0 and a["chunk"] == 0 and a["vstage"] == 0 for a in forward)
    scale = next(a for k, a in out["spans"] if k == "dp_sync")
    assert scale["op"] == "reduce_grad" and scale["scale"] == 2
