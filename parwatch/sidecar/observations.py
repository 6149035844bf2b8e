"""Turn what the store holds into the guardrail engine's Observation for one global step.

Rank 0's summary carries the fast-path view of the whole pipeline (loss, every stage's
bubble, skew); per-rank series (liveness, collective latency, GPU utilisation) come from
the latest summary of every rank that is still reporting.
"""

from __future__ import annotations

from parwatch.bubble import excess
from parwatch.guardrails.engine import Observation
from parwatch.sidecar.store import Store
from parwatch.wire.steps import GlobalView, StepSummary

WARMUP_STEPS = 2
"""A process's first steps pay one-time costs (allocation, lazy initialisation, the first collectives' set-up,
compilation), unevenly by stage: the demo's stage 0 computed 4x its steady time on its first step and 1.5x on
its second, stage 1 1.9x and 1x, so the stage-skew rule (1.25 for 2 steps) fired on start-up and named stage 0.
The run's pace (bubble, skew, step time) is not judged on them; the loss and liveness are, from the first step."""


def build_observation(store: Store) -> Observation | None:
    """The Observation for the newest global step, or None before rank 0 sent one."""
    view = store.global_view
    rank0 = store.ranks.get(0)
    if view is None or rank0 is None:
        return None
    series: dict[str, dict[str, float]] = {}
    if view.loss is not None:
        series["loss"] = {"": view.loss}
    if view.step >= rank0.first_step + WARMUP_STEPS:
        series.update(_pace_series(view, rank0.summary))
    series.update(_per_rank_series(store))
    store.ledger_window.add(store.clock(), store.ledgers())
    ratios = store.ledger_window.ratios()
    if ratios is not None:
        series["goodput_ratio"] = {"": ratios["goodput_ratio"]}
        series["ettr_ratio"] = {"": ratios["ettr"]}
    return Observation(
        step=view.step,
        time=store.clock(),
        series=series,
        checkpoints=store.checkpoints,
        process_start_time=rank0.summary.process_start_time,
    )


def _pace_series(view: GlobalView, rank0: StepSummary) -> dict[str, dict[str, float]]:
    """The pipeline's shape from rank 0's view: every stage's bubble and its excess, the step time, the skew."""
    series: dict[str, dict[str, float]] = {}
    if view.stages:
        series["bubble_ratio"] = {f"stage={st.stage}": st.bubble_ratio for st in view.stages}
        theoretical = rank0.bubble_theoretical_ratio
        series["bubble_excess_ratio"] = {
            f"stage={st.stage}": excess(st.bubble_ratio, theoretical) for st in view.stages
        }
        series["step_seconds"] = {"": max(st.step_seconds for st in view.stages)}
    else:
        series["step_seconds"] = {"": rank0.step_seconds}
    if view.pipeline_skew_ratio is not None:
        # Keyed by the slowest stage, so the rule's reason and evidence name it.
        slowest = max(view.stages, key=lambda st: st.compute_seconds).stage if view.stages else None
        series["pipeline_skew_ratio"] = {"" if slowest is None else f"stage={slowest}": view.pipeline_skew_ratio}
    return series


_RANK_KEYS: dict[int, str] = {}  # capped (hostile rank numbers must not grow it); ops/groups are a closed list
_RANK_KEYS_MAX = 65_536
_OP_KEYS: dict[tuple[str, str], str] = {}


def rank_key(rank: int) -> str:
    """An observation's series key for a rank, "rank=N" (made once per rank, up to _RANK_KEYS_MAX)."""
    key = _RANK_KEYS.get(rank)
    if key is None:
        key = f"rank={rank}"
        if len(_RANK_KEYS) < _RANK_KEYS_MAX:
            _RANK_KEYS[rank] = key
    return key


def _per_rank_series(store: Store) -> dict[str, dict[str, float]]:
    rank_up: dict[str, float] = {}
    collective_mean: dict[str, float] = {}
    gpu_util: dict[str, float] = {}
    live = store.liveness()  # activity first, where the hub knows it: the same view the tick feeds
    for rank, rec in sorted(store.ranks.items()):
        rank_up[rank_key(rank)] = 1.0 if live.get(rank, True) else 0.0
        up = store.is_up(rec)
        if not up:
            continue  # a silent rank's last numbers are stale evidence
        s = rec.summary
        for c in s.collectives:
            if c.count:
                key = _OP_KEYS.get((c.op, c.group))
                if key is None:
                    key = _OP_KEYS[(c.op, c.group)] = f"op={c.op},group={c.group}"
                mean = c.seconds / c.count
                if mean > collective_mean.get(key, -1.0):  # worst rank: the straggler is the finding
                    collective_mean[key] = mean
        if s.gpu is not None and s.gpu.utilization_ratio is not None:
            gpu_util[f"rank={rank},gpu={s.gpu.index}"] = s.gpu.utilization_ratio
    out = {"rank_up": rank_up}
    if collective_mean:
        out["collective_seconds_mean"] = collective_mean
    if gpu_util:
        out["gpu_utilization_ratio"] = gpu_util
    return out
