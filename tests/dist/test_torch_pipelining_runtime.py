"""torch's `_PipelineScheduleRuntime` running actions loaded from a CSV (torchtitan's
pipeline_parallel_schedule_csv), watched on 2 gloo ranks: it is named "custom", its theory is the
replay of the loaded actions, every action gets its span, and the losses are those of the torch
class whose actions the CSV holds (interleaved 1F1B, p=2, m=4, v=2)."""

from __future__ import annotations

import os

import pytest

from tests.distutil import run_ranks

pytestmark = [pytest.mark.beside_serial, pytest.mark.dist, pytest.mark.timeout(120)]
P, M, V, STEPS = 2, 4, 2, 3


def runtime_body(rank: int, world_size: int, csv_path: str, log_dir: str) -> dict:
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from parwatch.collector import Collector, attach
    from parwatch.integrations.torch_pipelining import PipelineWatch

    def run(make, watched: bool) -> dict:
        torch.manual_seed(0)
        modules = [torch.nn.Linear(4, 4) for _ in range(P * V)]
        stages = [PipelineStage(modules[s], s, P * V, torch.device("cpu")) for s in range(rank, P * V, P)]
        schedule = make(stages)
        opt = torch.optim.SGD([p for s in range(rank, P * V, P) for p in modules[s].parameters()], lr=0.1)
        watch = collector = None
        if watched:
            watch = PipelineWatch(schedule, run_id="runtime")
            collector = attach(
                Collector(
                    watch.run_context(),
                    log_path=os.path.join(log_dir, "summaries.jsonl"),
                    spans_path=os.path.join(log_dir, "spans.jsonl"),
                )
            )
            watch.start()
        losses = []
        for step in range(1, STEPS + 1):
            torch.manual_seed(step)
            x, y = torch.randn(8, 4), torch.randn(8, 4)
            opt.zero_grad()
            mb: list = []
            schedule.step(x, target=y, losses=mb) if rank == 0 else schedule.step(target=y, losses=mb)
            losses.append([repr(float(t)) for t in mb])
            if watch:
                watch.optimizer_step(opt)
                watch.step_done()
            else:
                opt.step()
        out = {"losses": losses}
        if watch:
            out.update(
                name=watch.name,
                theory=collector.last_summary.bubble_theoretical_ratio,
                schedule=collector.last_summary.schedule,
            )
            watch.close()
            collector.close()
        return out

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    def from_csv(stages):
        schedule = _PipelineScheduleRuntime(stages, M, loss_fn=loss_fn)
        schedule._load_csv(csv_path)
        return schedule

    watched = run(from_csv, watched=True)
    plain = run(lambda stages: ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn), watched=False)
    return {**watched, "plain_losses": plain["losses"]}


def test_a_schedule_loaded_from_csv_is_watched_as_custom(tmp_path):
    import json

    from parwatch import pipeline_sim as ps
    from parwatch.bubble import theoretical
    from tests.torch_orders import torch_order

    order = torch_order("Interleaved1F1B", P, M, V)
    csv_path = tmp_path / "schedule.csv"
    csv_path.write_text("".join(",".join(str(a) for a in order[r] if a is not None) + "\n" for r in range(P)))
    out = run_ranks(runtime_body, P, str(csv_path), str(tmp_path / "run"), timeout=100)
    for o in out:
        assert o["name"] == o["schedule"] == "custom"
        # the replay of the loaded (interleaved 1F1B) actions at equal times is that schedule's formula
        assert o["theory"] == pytest.approx(theoretical("interleaved", P, M, V), abs=1e-9)
        assert o["losses"] == o["plain_losses"]
    assert any(o["losses"][0] for o in out)  # the last stage's rank computed the losses
    seen: dict = {}
    with open(tmp_path / "run" / "spans.jsonl") as f:
        for line in f:
            span = json.loads(line)
            kind = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}.get(span["kind"])
            if kind and span["step"] == 2:
                seen.setdefault(span["rank"], set()).add(
                    str(ps.Action(span["attrs"]["vstage"], kind, span["attrs"]["microbatch"]))
                )
    assert seen == {r: {str(a) for a in acts} for r, acts in ps.normalize(order).items()}
