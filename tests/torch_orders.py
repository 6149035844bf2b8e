"""torch's own action lists for every schedule class, without a process group.

torch's schedules compute `pipeline_order` for every rank at construction time; the stages
they are given only need their index, the stage count and the group's size and rank.
"""

from __future__ import annotations

import types

import torch
from torch.distributed.pipelining import schedules as torch_schedules

ALL_CLASSES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_STYLE = ("ZBVZeroBubble", "DualPipeV")


def _fake_stage(index: int, num_stages: int, p: int):
    return types.SimpleNamespace(
        stage_index=index,
        num_stages=num_stages,
        group_size=p,
        group_rank=0,
        submod=torch.nn.Linear(1, 1),
        is_first=index == 0,
        is_last=index == num_stages - 1,
    )


def torch_schedule(name: str, p: int, m: int, v: int = 1):
    """torch's schedule class `name` (get_schedule_class) at p ranks, m microbatches, as rank 0 builds it."""
    cls = torch_schedules.get_schedule_class(name)
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        return cls(_fake_stage(0, p, p), m, loss_fn=lambda out, target: out)
    local = [0, 2 * p - 1] if name in V_STYLE else list(range(0, p * v, p))
    stages = [_fake_stage(i, p * v, p) for i in local]
    return cls(stages, m, loss_fn=lambda out, target: out)


def torch_order(name: str, p: int, m: int, v: int = 1) -> dict:
    """`schedule.pipeline_order` of torch's class `name` at p ranks, m microbatches."""
    return torch_schedule(name, p, m, v).pipeline_order
