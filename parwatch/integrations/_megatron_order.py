"""The compute order Megatron-Core's pipeline schedules run, per rank, as `pipeline_sim` actions.

Pure Python, no Megatron import: the same arithmetic as megatron.core.pipeline_parallel.schedules
(0.16): `get_pp_rank_microbatches` (warm-up counts) and `get_schedule_table` (which microbatch and
model chunk each virtual microbatch is). Virtual stage of chunk c on pipeline rank r: c * p + r.

- v = 1 (`forward_backward_pipelining_without_interleaving`, and `..._no_pipelining` at p = 1):
  p - r - 1 warm-up forwards, then forward/backward pairs, then the cool-down backwards. As a
  sequence of actions that is exactly torch's 1F1B, so `pipeline_sim.single_stage_order` gives it.
- v > 1 (`forward_backward_pipelining_with_interleaving`): (p - r - 1) * 2 + (v - 1) * g warm-up
  forwards (g = microbatch_group_size_per_vp_stage), then one forward and one backward per
  virtual microbatch k, the backward of k running chunk v - 1 - chunk(k).
"""

from __future__ import annotations

from parwatch.pipeline_sim import Action, B, F, single_stage_order


def schedule_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each virtual microbatch: groups of `group` microbatches, every chunk in
    turn within a group; the last group takes what is left."""
    table: list[tuple[int, int]] = []
    for first in range(0, m, group):
        last = m if first + group >= m else first + group
        table.extend((mb, chunk) for chunk in range(v) for mb in range(first, last))
    return table


def warmup_microbatches(p: int, rank: int, m: int, v: int, group: int) -> int:
    """Forwards rank `rank` runs before its first backward (virtual microbatches)."""
    if v == 1:
        return min(p - rank - 1, m)
    return min((p - rank - 1) * 2 + (v - 1) * group, m * v)


def megatron_order(p: int, m: int, v: int = 1, group: int | None = None) -> dict[int, list[Action]]:
    """`{rank: [Action, ...]}` of Megatron's 1F1B (v = 1) or interleaved 1F1B (v > 1) at p pipeline
    ranks and m microbatches; `group`: microbatch_group_size_per_vp_stage (default p, Megatron's)."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"megatron_order: p={p}, m={m} and v={v} must be >= 1")
    if v == 1:
        return single_stage_order("1f1b", p, m)
    group = p if group is None else group
    if group < 1:
        raise ValueError(f"megatron_order: microbatch_group_size_per_vp_stage={group} must be >= 1")
    table = schedule_table(m, v, group)
    total = m * v
    order: dict[int, list[Action]] = {}
    for rank in range(p):

        def forward(k: int, rank: int = rank) -> Action:
            mb, chunk = table[k]
            return Action(chunk * p + rank, F, mb)

        def backward(k: int, rank: int = rank) -> Action:
            mb, chunk = table[k]
            return Action((v - 1 - chunk) * p + rank, B, mb)

        warmup = warmup_microbatches(p, rank, m, v, group)
        acts = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [forward(warmup + k), backward(k)]
        acts += [backward(k) for k in range(total - warmup, total)]
        order[rank] = acts
    return order
