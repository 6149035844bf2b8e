"""Synthetic step summaries (schema v1) for tests, benchmarks and demos without a trainer.

The numbers obey the design's definitions: idle = step - compute - other, bubble and
theoretical bubble as parwatch.bubble defines them.
"""

from __future__ import annotations

from parwatch.bubble import closed_form, stage_bubble
from parwatch.schema import COLLECTIVE_BUCKETS, SCHEMA_VERSION, busbw_factor
from parwatch.vocabulary import coords, jsonable


def collective(op: str, group: str, count: int, seconds_each: float, nbytes_each: int, n: int) -> dict:
    le_counts = [count if seconds_each <= b else 0 for b in COLLECTIVE_BUCKETS]
    seconds = count * seconds_each
    algbw = nbytes_each / seconds_each if seconds_each > 0 else 0.0
    return {
        "op": op,
        "group": group,
        "count": count,
        "seconds": seconds,
        "bytes": count * nbytes_each,
        "buckets": le_counts,
        "algbw": algbw,
        "busbw": algbw * busbw_factor(op, n),
    }


def summary(
    rank: int,
    step: int,
    *,
    run_id: str = "synthetic",
    tp: int = 1,
    pp: int = 2,
    dp: int = 1,
    microbatches: int = 4,
    schedule: str = "1f1b",
    step_seconds: float = 0.5,
    other_seconds: float = 0.02,
    compute_scale: float = 1.0,
    loss: float | None = 2.0,
    time: float = 0.0,
    gpu: bool = True,
    checkpoints=(),
    global_stages: list | None = None,
    global_loss: float | None = None,
    timeline: int = 0,
    instances: bool = True,
) -> dict:
    """One rank's summary; rank 0 carries `global` for step-1 when global_stages is given."""
    tp_rank, stage, dp_rank = coords(rank, tp, pp)
    theory = closed_form(pp, microbatches)
    compute = (step_seconds - other_seconds) * (1 - theory) * compute_scale
    idle = step_seconds - compute - other_seconds
    s = {
        "v": SCHEMA_VERSION,
        "run_id": run_id,
        "rank": rank,
        "stage": stage,
        "tp_rank": tp_rank,
        "dp_rank": dp_rank,
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "microbatches": microbatches,
        "chunks": 1,
        "schedule": schedule,
        "step": step,
        "timeline": timeline,
        "time": time,
        "step_seconds": step_seconds,
        "compute_seconds": compute,
        "other_seconds": other_seconds,
        "idle_seconds": idle,
        "bubble_ratio": stage_bubble(idle, compute),
        "bubble_theoretical_ratio": theory,
        "loss": jsonable(loss) if stage == pp - 1 and tp_rank == 0 else None,
        "tokens": 4096,
        "memory_max_allocated_bytes": 1 << 30,
        "collectives": [
            collective("all_reduce", "tp", 8, 0.002, 1 << 20, tp),
            collective("send", "pp", microbatches, 0.0005, 1 << 18, 2),
        ],
        "gpu": (
            {
                "index": rank % 8,
                "utilization_ratio": 0.9,
                "memory_used_bytes": 2 << 30,
                "memory_total_bytes": 80 << 30,
                "power_watts": 300.0,
                "sm_clock_hertz": 1.4e9,
                "temperature_celsius": 60.0,
                "throttle_reasons": 0,
            }
            if gpu
            else None
        ),
        "nvml_up": 1 if gpu else 0,
        "overhead_seconds": 0.001,
        "dropped_total": 0,
        "checkpoints": list(checkpoints) if rank == 0 else [],
        "paused": False,
        "instances": _instances(rank, step, tp, pp, microbatches) if instances else None,
    }
    if rank == 0 and global_stages is not None:
        s["global"] = {
            "step": step - 1,
            "loss": jsonable(global_loss if global_loss is not None else loss),
            "pipeline_skew_ratio": _skew(global_stages),
            "stages": global_stages,
        }
    return s


def _instances(rank: int, step: int, tp: int, pp: int, microbatches: int) -> dict:
    """Instance records matching `collectives`: 8 TP all-reduces of 2 ms with no wait, and the
    p2p activations to the next stage (0.5 ms, no wait), numbered per group from step 1."""
    tp_rank, stage, _ = coords(rank, tp, pp)
    records, groups = [], {}
    if tp > 1:
        groups["tp"] = [rank - tp_rank + t for t in range(tp)]
        records += [["all_reduce", "tp", (step - 1) * 8 + i + 1, -1, 0, 2000, 1 << 20] for i in range(8)]
    for i in range(microbatches):
        seq = (step - 1) * microbatches + i + 1
        if stage < pp - 1:
            records.append(["send", "pp", seq, rank + tp, 0, 500, 1 << 18])
        if stage > 0:
            records.append(["recv", "pp", seq, rank - tp, 0, 500, 1 << 18])
    return {"host": "synthetic", "data_seconds": 0.001, "groups": groups, "records": records, "capped": 0}


def stage_view(stage: int, step_seconds: float, compute_seconds: float, other_seconds: float = 0.02) -> dict:
    idle = step_seconds - compute_seconds - other_seconds
    return {
        "stage": stage,
        "compute_seconds": compute_seconds,
        "idle_seconds": idle,
        "other_seconds": other_seconds,
        "step_seconds": step_seconds,
        "bubble_ratio": stage_bubble(idle, compute_seconds),
    }


def _skew(stages: list) -> float | None:
    if not stages:
        return None
    computes = [s["compute_seconds"] for s in stages]
    mean = sum(computes) / len(computes)
    return max(computes) / mean if mean > 0 else None


def outcome(
    directive_id: int,
    *,
    run_id: str = "synthetic",
    result: str = "applied",
    step: int = 1,
    ranks: int = 2,
    loaded_step: int | None = None,
    reasons: dict | None = None,
) -> dict:
    """Rank 0's outcome record of a directive that every one of `ranks` ranks handled alike."""
    return {
        "directive_id": directive_id,
        "run_id": run_id,
        "outcome": result,
        "step": step,
        "loaded_step": loaded_step,
        "counts": {result: ranks},
        "reasons": reasons or {},
        "ranks": ranks,
    }
