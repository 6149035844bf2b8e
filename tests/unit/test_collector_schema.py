"""A produced summary holds every field of the StepSummary record (parwatch/wire/steps.py), with the
contract's types, and the sidecar's decoder takes it."""

from __future__ import annotations

import json

import msgspec
from test_collector_nvml import FakeNvml, sample
from test_collector_sim import SimRank, SimRun, ctx_for, run_steps

from parwatch.rank_layout import ORDERS
from parwatch.vocabulary import REFERENCE_SCHEDULES, BubbleCause, SelfPart, TimeCategory
from parwatch.wire.bounds import SCHEMA_VERSION
from parwatch.wire.codec import parse
from parwatch.wire.steps import COLLECTIVE_BUCKETS, IngestBody, StepSummary

NUMBER = (int, float)
LOSS_STRINGS = ("nan", "inf", "-inf")


def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def is_float(x):
    return isinstance(x, float)


def is_loss(x):
    return x is None or x in LOSS_STRINGS or (isinstance(x, NUMBER) and not isinstance(x, bool))


COLLECTIVE_KEYS = {"op", "group", "count", "seconds", "bytes", "buckets", "algbw", "busbw"}
GPU_KEYS = {
    "index",
    "utilization_ratio",
    "memory_used_bytes",
    "memory_total_bytes",
    "power_watts",
    "sm_clock_hertz",
    "temperature_celsius",
    "throttle_reasons",
}
STAGE_KEYS = {
    "stage",
    "compute_seconds",
    "idle_seconds",
    "other_seconds",
    "step_seconds",
    "bubble_ratio",
    "forward_seconds",
    "backward_seconds",
    "backward_weight_seconds",
    "loss_seconds",
    "ranks",
}


def valid_collective(c):
    return (
        set(c) == COLLECTIVE_KEYS
        and isinstance(c["op"], str)
        and isinstance(c["group"], str)
        and is_int(c["count"])
        and is_float(c["seconds"])
        and is_int(c["bytes"])
        and len(c["buckets"]) == len(COLLECTIVE_BUCKETS) + 1
        and c["buckets"][-1] == c["count"]
        and all(is_int(b) for b in c["buckets"])
        and is_float(c["algbw"])
        and is_float(c["busbw"])
    )


def valid_gpu(g):
    return g is None or (set(g) == GPU_KEYS and is_int(g["index"]))


def valid_instances(x):
    return (
        set(x) == {"host", "data_seconds", "groups", "records", "capped"}
        and isinstance(x["host"], str)
        and is_float(x["data_seconds"])
        and is_int(x["capped"])
        and isinstance(x["groups"], dict)
        and all(isinstance(r, list) and len(r) == 7 for r in x["records"])
    )


def valid_global(g):
    return g is None or (
        set(g) == {"step", "loss", "pipeline_skew_ratio", "slowest_stage", "stages"}
        and is_int(g["step"])
        and is_loss(g["loss"])
        and is_int(g["slowest_stage"])
        and is_float(g["pipeline_skew_ratio"])
        and all(STAGE_KEYS <= set(s) <= STAGE_KEYS | {c.ratio_field for c in BubbleCause} for s in g["stages"])
        and all(is_int(s["stage"]) for s in g["stages"])
    )


FIELD_CHECKS = {
    "v": lambda x: x == SCHEMA_VERSION,
    "run_id": lambda x: isinstance(x, str),
    **{
        k: is_int
        for k in (
            "rank",
            "stage",
            "tp_rank",
            "dp_rank",
            "tp",
            "pp",
            "dp",
            "microbatches",
            "chunks",
            "step",
            "timeline",
            "tokens",
            "dropped_total",
            "pid",
        )
    },
    "schedule": lambda x: isinstance(x, str) and x in REFERENCE_SCHEDULES,
    "order": lambda x: x in ORDERS,
    **{
        k: is_float
        for k in (
            "time",
            "step_seconds",
            "compute_seconds",
            "other_seconds",
            "idle_seconds",
            "bubble_ratio",
            "bubble_theoretical_ratio",
            "overhead_seconds",
            "process_start_time",
        )
    },
    "loss": is_loss,
    "memory_max_allocated_bytes": lambda x: x is None or is_int(x),
    "collectives": lambda x: isinstance(x, list) and all(valid_collective(c) for c in x),
    "gpu": valid_gpu,
    "nvml_up": lambda x: x in (0, 1) and is_int(x),
    "checkpoints": lambda x: isinstance(x, list) and all(is_int(s) for s in x),
    "paused": lambda x: isinstance(x, bool),
    "global": valid_global,
    "instances": valid_instances,
    "model_flops_utilization_ratio": lambda x: x is None or is_float(x),
    "check": lambda x: x is None or (isinstance(x, dict) and {"action", "fault", "triage", "applied"} <= set(x)),
    "time_seconds": lambda x: (
        isinstance(x, dict) and set(x) == set(TimeCategory) and all(is_float(v) for v in x.values())
    ),
    "self_seconds": lambda x: (
        isinstance(x, dict) and set(x) == set(SelfPart) and all(is_float(v) and v >= 0 for v in x.values())
    ),
}


SENT_WHEN_CONFIGURED = {"model_flops_utilization_ratio", "check"}
"""Fields a collector fills only when told more (--parwatch-peak-flops), or when something happened (check:
the check before the optimizer step found the step bad); null otherwise."""


def schema_fields(optional: bool = False) -> set[str]:
    """The StepSummary record's wire names (parwatch/wire/steps.py): those every summary carries, or
    (optional=True) those sent only when configured."""
    names = {f.encode_name for f in msgspec.structs.fields(StepSummary)}
    return names & SENT_WHEN_CONFIGURED if optional else names - SENT_WHEN_CONFIGURED


def produced_summaries(tmp_path):
    fake = FakeNvml([sample(60, 2**30, 150_000, 1500, 60, 0)] * 1000)
    run = SimRun(
        [
            SimRank(
                ctx_for(r, local_gpu=r),
                nvml=fake,
                memory_fn=lambda: 4096,
                log_path=str(tmp_path / f"summaries-{r}.jsonl"),
            )
            for r in range(2)
        ]
    )
    for rank in run.ranks:
        rank.collector.nvml.sample_once()  # a sample now, not at the sampling thread's whim
    run.boundary(0, "start", 0.0, 0.1)
    for rank in run.ranks:
        rank.registry.emit_event("checkpoint_saved", step=0)
    run_steps(run, 3, 0.1, tp_allreduce=0.001, dp_sync=0.002, loss=lambda step: float("inf") if step == 3 else 1.0)
    for rank in run.ranks:
        rank.collector.close(timeout=30)
    return run


def test_the_field_table_covers_the_schema_exactly():
    assert set(FIELD_CHECKS) == schema_fields() | schema_fields(optional=True)
    assert schema_fields(optional=True) == {"model_flops_utilization_ratio", "check"}


def test_every_summary_has_every_field_with_its_type(tmp_path):
    run = produced_summaries(tmp_path)
    for r, _rank in enumerate(run.ranks):
        lines = (tmp_path / f"summaries-{r}.jsonl").read_text().splitlines()
        assert len(lines) == 3
        for line in lines:
            summary = json.loads(line)
            assert schema_fields() <= set(summary) <= schema_fields() | schema_fields(optional=True)
            bad = [k for k, check in FIELD_CHECKS.items() if k in summary and not check(summary[k])]
            assert not bad, f"rank {r} step {summary['step']}: wrong type for {bad}: {[summary[k] for k in bad]}"
        parse({"version": 1, "summaries": [json.loads(line) for line in lines]}, IngestBody)  # the sidecar takes them
        last = json.loads(lines[-1])
        assert last["loss"] == "inf" and last["gpu"] is not None and last["nvml_up"] == 1
        assert all(json.loads(line)["timeline"] == 0 for line in lines)
    rank0_last = json.loads((tmp_path / "summaries-0.jsonl").read_text().splitlines()[-1])
    assert rank0_last["global"] is not None and rank0_last["checkpoints"] == [0]
