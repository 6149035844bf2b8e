"""The /metrics collector: fresh metric families from the store and engine on every scrape.

A custom collector on a private registry (no global state, no multiprocess mode), so the
series of a rank that went away disappear by themselves once the store stops listing it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from parwatch import __version__, goodput
from parwatch.catalog import GUARDRAIL_STATES, STEP_BUCKETS, metric
from parwatch.sidecar.store import RankRecord, Store
from parwatch.sidecar.transfer import COLLECTIVE_LE, transfer_families
from parwatch.vocabulary import BubbleCause, MetricKind

_STEP_LE = [repr(float(b)) for b in STEP_BUCKETS]

GPU_GAUGES = ("utilization_ratio", "memory_used_bytes", "power_watts", "sm_clock_hertz", "temperature_celsius")
"""A step summary's gpu fields, each exported as parwatch_gpu_<field>."""


@dataclass
class SidecarCounters:
    """Counters the sidecar itself keeps (they restart at zero with the process)."""

    actions: Counter = field(default_factory=Counter)
    """(rule, action) -> guardrail decisions that acted (or would have, in dry run)."""
    rules_reload_failures: int = 0
    """SIGHUP reloads refused because the new rules file was invalid."""


def _g(name, labels=()):
    """A gauge family with the catalogue's HELP (parwatch/catalog.py: the one place a metric is described)."""
    return GaugeMetricFamily(name, metric(name).help, labels=list(labels))


def _c(name, labels=()):
    return CounterMetricFamily(name, metric(name + "_total").help, labels=list(labels))


class SidecarCollector(Collector):
    """Reads only whole, immutable values from the store (see store.py), so a scrape may be
    interleaved with ingests."""

    def __init__(self, store: Store, engine, counters: SidecarCounters, transfer=None, judges_rules=lambda: True):
        self.store = store
        self.engine = engine
        self.counters = counters
        self.transfer = transfer  # parwatch.sidecar.transfer.TransferTracker: wait/transfer families
        self.judges_rules = judges_rules
        """False on a node sidecar: the leader judges the run, and this engine's idle "ok" would mislead."""

    def collect(self):
        yield from self._run_families()
        yield from self._rank_families()
        yield from self._collective_families()
        if self.transfer is not None:
            yield from transfer_families(self.transfer)
        yield from self._guardrail_families()

    def _run_families(self):
        st = self.store
        info = InfoMetricFamily(
            "parwatch_run",
            "The run this sidecar watches",
            labels=["run_id", "schedule", "tp", "pp", "dp", "order", "microbatches", "version"],
        )
        head = st.run_summary()
        if head is not None:
            info.add_metric(
                [
                    head.run_id,
                    head.schedule,
                    *(str(n) for n in (head.tp, head.pp, head.dp)),
                    head.order,
                    str(head.microbatches),
                    __version__,
                ],
                {},
            )
        yield info
        step = _g("parwatch_train_step")
        last_step = st.last_step
        if last_step is not None:
            step.add_metric([], last_step)
        yield step
        loss = _g("parwatch_loss")
        value = _latest_loss(st)
        nonfinite = _g("parwatch_loss_nonfinite")
        if value is not None:
            loss.add_metric([], value)
            # VictoriaMetrics drops NaN samples at ingestion: a NaN loss reaches it only as this flag.
            nonfinite.add_metric([], 0.0 if math.isfinite(value) else 1.0)
        yield loss
        yield nonfinite
        tokens = _c("parwatch_tokens")
        if head is not None:
            tokens.add_metric([], st.tokens_total)
        yield tokens
        skew = _g("parwatch_pipeline_skew_ratio")
        view = st.global_view
        if view is not None and view.pipeline_skew_ratio is not None:
            skew.add_metric([], view.pipeline_skew_ratio)
        yield skew
        for cause in BubbleCause:
            family = _g(cause.metric, ["stage"])
            for stage in view.stages if view is not None else ():
                value = getattr(stage, cause.ratio_field)
                if value is not None:
                    family.add_metric([str(stage.stage)], value)
            yield family
        # Step time as Google's ml-goodput-measurement reads it (parwatch.goodput): none while no step
        # lasts 1 s, the library's floor.
        ideal_g, deviation_g = _g("parwatch_ideal_step_seconds"), _g("parwatch_step_time_deviation_seconds")
        times = list(st.step_times)
        ideal = goodput.ideal_step_time(times)
        if ideal is not None:
            ideal_g.add_metric([], ideal)
            deviation_g.add_metric([], goodput.deviation_gauge([abs(t - ideal) for t in times]))
        yield ideal_g
        yield deviation_g
        ckpt = _g("parwatch_checkpoint_last_good_step")
        checkpoints = st.checkpoints
        if checkpoints:
            ckpt.add_metric([], max(checkpoints))
        yield ckpt

    def _rank_families(self):
        st = self.store
        records = st.visible()  # parwatch_rank_up: sidecar/rank_gauges.py
        for name, typ, labels, value_of in PER_RANK:
            family = (_g if typ == MetricKind.GAUGE else _c)(name, labels)
            for rec in records:
                value = value_of(rec)
                if value is not None:
                    s = rec.summary
                    family.add_metric([str(s.rank)] if labels == RANK else [str(s.rank), str(s.stage)], value)
            yield family
        spent = _c("parwatch_time_seconds", ["rank", "stage", "category"])
        for rec in records:
            s = rec.summary
            for category, seconds in sorted((rec.time_seconds() or {}).items()):
                spent.add_metric([str(s.rank), str(s.stage), category], seconds)
        yield spent
        own = _c("parwatch_self_seconds", ["rank", "part"])
        for rec in records:
            for part, seconds in sorted((rec.summary.self_seconds or {}).items()):
                own.add_metric([str(rec.summary.rank), part], seconds)
        yield own
        # One step histogram per stage: the boundary collective ends a step on every rank, so a stage's
        # ranks share its period, and one copy per rank was 16 of a rank's 32 series.
        per_stage: dict[int, RankRecord] = {}
        for rec in records:  # by rank: the first of each stage is its lowest rank here
            per_stage.setdefault(rec.summary.stage, rec)
        step = metric("parwatch_step_duration_seconds")
        hist = HistogramMetricFamily(step.name, step.help, labels=["stage"])
        for stage in sorted(per_stage):
            t = per_stage[stage].totals  # one immutable value: buckets and count always agree
            hist.add_metric([str(stage)], [*zip(_STEP_LE, t.step_buckets), ("+Inf", t.step_count)], t.step_sum)
        yield hist
        for field_name in GPU_GAUGES:
            gauge = _g(f"parwatch_gpu_{field_name}", ["rank", "gpu"])
            for rec in records:
                gpu = rec.summary.gpu
                if gpu is not None and (value := getattr(gpu, field_name)) is not None:
                    gauge.add_metric([str(rec.summary.rank), str(gpu.index)], value)
            yield gauge
        theory = _g("parwatch_stage_bubble_theoretical_ratio", ["stage"])
        by_stage = {rec.summary.stage: rec.summary.bubble_theoretical_ratio for rec in records}
        for stage, ratio in sorted(by_stage.items()):
            theory.add_metric([str(stage)], ratio)
        yield theory

    def _collective_families(self):
        og = ["op", "group"]
        hist = HistogramMetricFamily(
            "parwatch_collective_duration_seconds", "Collective latency, summed over this sidecar's ranks", labels=og
        )
        nbytes = _c("parwatch_collective_bytes", og)
        for (op, group), tot in sorted(list(self.store.collectives.items())):
            hist.add_metric([op, group], [*zip(COLLECTIVE_LE, tot.buckets), ("+Inf", tot.count)], tot.seconds)
            nbytes.add_metric([op, group], tot.bytes)
        # Bus bandwidth comes from transfer time only (parwatch.sidecar.transfer), not these durations,
        # which include each rank's wait for the last arrival.
        yield from (hist, nbytes)

    def _guardrail_families(self):
        state = _g("parwatch_guardrail_state", ["rule"])
        if self.judges_rules():
            for name, info in sorted(self.engine.states().items()):
                state.add_metric([name], GUARDRAIL_STATES.get(info.get("state"), 0))
        yield state
        actions = _c("parwatch_guardrail_actions", ["rule", "action"])
        for (rule, action), n in sorted(dict(self.counters.actions).items()):
            actions.add_metric([rule, action], n)
        yield actions
        paused = _g("parwatch_run_paused")
        paused.add_metric([], 1.0 if self.engine.paused else 0.0)
        yield paused
        transients = _c("parwatch_rank_transient_faults", ["rank"])
        if self.judges_rules():  # the leader's count (rank 0's records reach it alone)
            for rank, n in sorted(self.engine.transient_faults().items()):
                transients.add_metric([str(rank)], n)
        yield transients
        failures = _c("parwatch_sidecar_rules_reload_failures")
        failures.add_metric([], self.counters.rules_reload_failures)
        yield failures


RANK, RANK_STAGE = ("rank",), ("rank", "stage")


def _overhead_ratio(rec):
    s = rec.summary
    return s.overhead_seconds / s.step_seconds if s.step_seconds > 0 else 0.0


# (family name, type, help, labels, value of a rank record or None to leave the rank out)
PER_RANK = (
    (
        "parwatch_model_flops_utilization_ratio",
        "gauge",
        RANK,
        lambda rec: rec.summary.model_flops_utilization_ratio,
    ),
    (
        "parwatch_torch_memory_max_allocated_bytes",
        "gauge",
        RANK_STAGE,
        lambda rec: rec.summary.memory_max_allocated_bytes,
    ),
    (
        "parwatch_stage_compute_seconds",
        "counter",
        RANK_STAGE,
        lambda rec: rec.totals.compute_total,
    ),
    (
        "parwatch_stage_idle_seconds",
        "counter",
        RANK_STAGE,
        lambda rec: rec.totals.idle_total,
    ),
    (
        "parwatch_stage_bubble_ratio",
        "gauge",
        RANK_STAGE,
        lambda rec: rec.summary.bubble_ratio,
    ),
    ("parwatch_nvml_up", "gauge", RANK, lambda rec: rec.summary.nvml_up),
    (
        "parwatch_collector_overhead_ratio",
        "gauge",
        RANK,
        _overhead_ratio,
    ),
    (
        "parwatch_collector_dropped_summaries",
        "counter",
        RANK,
        lambda rec: rec.summary.dropped_total,
    ),
)


def _latest_loss(store: Store) -> float | None:
    """The newest step's loss: rank 0's summary carries the boundary's loss of its own step (the global
    view's is the step before, one step of lag), the same figure parwatch_train_step's step trained."""
    rank0 = store.ranks.get(0)
    if rank0 is not None and rank0.summary.loss is not None:
        return rank0.summary.loss
    view = store.global_view
    if view is not None and view.loss is not None:
        return view.loss
    # Without rank 0 here (a node sidecar): the newest loss any rank reported (last stage, tp_rank 0).
    newest = None
    for rec in list(store.ranks.values()):
        s = rec.summary
        if s.loss is not None and (newest is None or s.key > newest.key):
            newest = s
    return None if newest is None else newest.loss


def make_registry(
    store: Store, engine, counters: SidecarCounters, transfer=None, judges_rules=lambda: True
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SidecarCollector(store, engine, counters, transfer, judges_rules))
    return registry


__all__ = ["SidecarCollector", "SidecarCounters", "make_registry"]
