"""The metric catalogue: every series parwatch exports, defined once.

The dashboard (parwatch/dashboards.py), the recording rules (parwatch/recording.py), the alert
rules (parwatch/guardrails/alerts.py) and the tests read names, types and labels from here; the
sidecar's exporter is held to it by tests/unit/test_catalog.py. Conventions (DESIGN.md): prefix
`parwatch_`, base units, `_total` only on counters, ratios 0..1, `_info` for metadata, and bounded
labels only (never a step, microbatch or run id, except in the info metric).
"""

from __future__ import annotations

from dataclasses import dataclass

from parwatch.vocabulary import MetricKind, RankState, RuleState, SelfPart, TimeCategory
from parwatch.wire.steps import COLLECTIVE_BUCKETS

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper bounds (seconds) of the step duration histogram."""

KINDS = tuple(MetricKind)
BOUNDED_LABELS = frozenset(
    {
        "stage",
        "rank",
        "tp_rank",
        "dp_rank",
        "op",
        "group",
        "gpu",
        "rule",
        "action",
        "reason",
        "cause",
        "post",
        "category",
        "part",
        "tracker",
    }
)
"""reason: why a collective instance was not split (remote, incomplete, unsent), or why a post was refused
(parwatch.sidecar.refusals.REASONS); cause: a straggler's cause (parwatch.guardrails.attribution.CAUSES, four
values); post: ingest, activity or digest; category: where a second went (parwatch.vocabulary.TimeCategory, 15
values); part: where parwatch's own time went (parwatch.vocabulary.SelfPart, 4 values); tracker: an experiment
tracker the leader writes to (parwatch.vocabulary.Tracker, 3 values)."""
RANK_STATES = {RankState.RUNNING: 0, RankState.HUNG: 1, RankState.GONE: 2, RankState.UNKNOWN: 3}
"""parwatch_rank_state's value per state (one series per rank, the state as its value)."""
GUARDRAIL_STATES = {RuleState.OK: 0, RuleState.PENDING: 1, RuleState.FIRING: 2}
"""parwatch_guardrail_state's value per state."""


@dataclass(frozen=True)
class Metric:
    name: str
    """Name as exposed: counters end in _total, info metrics in _info, histograms add _bucket/_sum/_count."""
    kind: MetricKind
    labels: tuple[str, ...] = ()
    """Label names (bounded: never a step, microbatch or run id)."""
    help: str = ""
    """The HELP text: what one sample means."""
    unit: str = ""
    """Base unit of the value (seconds, bytes, ratio, ...); "" for counts and codes."""
    buckets: tuple[float, ...] = ()
    """Histogram bucket edges (le), without +Inf."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"metric {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if not self.name.startswith("parwatch_"):
            raise ValueError(f"metric {self.name}: names start with 'parwatch_'")
        if self.name.endswith("_total") != (self.kind == MetricKind.COUNTER):
            raise ValueError(f"metric {self.name}: '_total' is for counters and every counter ends in it")
        if self.kind == MetricKind.HISTOGRAM and not self.buckets:
            raise ValueError(f"metric {self.name}: a histogram needs its bucket edges")

    @property
    def family(self) -> str:
        """The name prometheus_client's metric families take (no _total, no _info)."""
        for suffix in ("_total", "_info"):
            if self.name.endswith(suffix):
                return self.name[: -len(suffix)]
        return self.name

    def series(self) -> tuple[str, ...]:
        """The sample names this metric exposes."""
        if self.kind == MetricKind.HISTOGRAM:
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)

    def series_per_label_set(self) -> int:
        """Series one label set costs: a histogram pays a bucket per edge, +Inf, _sum and _count."""
        return len(self.buckets) + 3 if self.kind == MetricKind.HISTOGRAM else 1

    def label_sets_per_rank(self) -> int:
        """Label sets one rank adds: one, or one per time category (the ledger's counters) or per part of
        parwatch's own time."""
        if "category" in self.labels:
            return len(TimeCategory)
        return len(SelfPart) if "part" in self.labels else 1


_R, _RS, _RG, _OG, _S = ("rank",), ("rank", "stage"), ("rank", "gpu"), ("op", "group"), ("stage",)
_G, _C, _H = MetricKind.GAUGE, MetricKind.COUNTER, MetricKind.HISTOGRAM

METRICS: tuple[Metric, ...] = (
    # The run.
    Metric(
        "parwatch_run_info",
        MetricKind.INFO,
        ("run_id", "schedule", "tp", "pp", "dp", "order", "microbatches", "version"),
        "The run this sidecar watches",
    ),
    Metric("parwatch_train_step", _G, (), "Newest optimizer step any rank reported"),
    Metric("parwatch_loss", _G, (), "Training loss of the newest step (NaN when non-finite)"),
    Metric(
        "parwatch_loss_nonfinite",
        _G,
        (),
        "1 while the newest loss is NaN or infinite, else 0 (stores that drop NaN samples keep this)",
    ),
    Metric("parwatch_tokens_total", _C, (), "Tokens the run consumed (all DP replicas); rate() is tokens/s"),
    Metric("parwatch_model_flops_utilization_ratio", _G, _R, "Model FLOPs utilisation", "ratio"),
    Metric("parwatch_torch_memory_max_allocated_bytes", _G, _RS, "Peak torch allocated memory in the step", "bytes"),
    Metric(
        "parwatch_step_duration_seconds",
        _H,
        _S,
        "Step period, boundary to boundary, of each stage's lowest rank at this sidecar (a step's boundary "
        "collective ends it on every rank, so its ranks share the period)",
        "seconds",
        tuple(STEP_BUCKETS),
    ),
    # The pipeline.
    Metric("parwatch_stage_compute_seconds_total", _C, _RS, "Forward + backward seconds", "seconds"),
    Metric("parwatch_stage_idle_seconds_total", _C, _RS, "Seconds waiting on neighbours and the flush", "seconds"),
    Metric("parwatch_stage_bubble_ratio", _G, _RS, "idle / (step - other) in the newest step", "ratio"),
    Metric("parwatch_stage_bubble_theoretical_ratio", _G, _S, "The schedule's bubble, (p-1)/(v*m+p-1)", "ratio"),
    Metric(
        "parwatch_stage_bubble_schedule_ratio",
        _G,
        _S,
        "Bubble the schedule causes at uniform stage times (formula or simulation)",
        "ratio",
    ),
    Metric(
        "parwatch_stage_bubble_imbalance_ratio",
        _G,
        _S,
        "Bubble from unequal stage times: simulated with this step's stage times, minus schedule",
        "ratio",
    ),
    Metric(
        "parwatch_stage_bubble_wait_ratio",
        _G,
        _S,
        "Bubble from waiting (p2p, collectives, host): measured minus simulated",
        "ratio",
    ),
    Metric("parwatch_pipeline_skew_ratio", _G, (), "Max over stages of compute seconds / mean over stages", "ratio"),
    # Collectives.
    Metric(
        "parwatch_collective_duration_seconds",
        _H,
        _OG,
        "Collective latency",
        "seconds",
        tuple(COLLECTIVE_BUCKETS),
    ),
    Metric(
        "parwatch_collective_transfer_seconds",
        _H,
        _OG,
        "Collective transfer time with the wait for the last rank's arrival removed",
        "seconds",
        tuple(COLLECTIVE_BUCKETS),
    ),
    Metric(
        "parwatch_collective_wait_seconds_total",
        _C,
        _OG,
        "Seconds ranks waited in collectives for the last rank to arrive",
        "seconds",
    ),
    Metric("parwatch_collective_bytes_total", _C, _OG, "Bytes moved by collectives", "bytes"),
    Metric(
        "parwatch_collective_busbw_bytes_per_second",
        _G,
        _OG,
        "Bus bandwidth (nccl-tests definition) from transfer time only, waiting excluded",
        "bytes_per_second",
    ),
    Metric(
        "parwatch_collective_unmatched_total",
        _C,
        ("op", "group", "reason"),
        "Collective/p2p instances not split into wait and transfer: a member's record never reached the "
        "sidecar that matches it (remote), was lost (incomplete), or could not be forwarded to the leader (unsent)",
    ),
    Metric(
        "parwatch_straggler_ratio",
        _G,
        ("cause",),
        "Share of the step the costliest straggler of each cause adds over its peers (0: none)",
        "ratio",
    ),
    # GPUs.
    Metric("parwatch_gpu_utilization_ratio", _G, _RG, "GPU busy share over the step (NVML)", "ratio"),
    Metric("parwatch_gpu_memory_used_bytes", _G, _RG, "GPU memory in use (NVML)", "bytes"),
    Metric("parwatch_gpu_power_watts", _G, _RG, "GPU power draw (NVML)", "watts"),
    Metric("parwatch_gpu_sm_clock_hertz", _G, _RG, "GPU SM clock (NVML)", "hertz"),
    Metric("parwatch_gpu_temperature_celsius", _G, _RG, "GPU temperature (NVML)", "celsius"),
    Metric("parwatch_nvml_up", _G, _R, "1 when NVML answered for this rank"),
    # Liveness and hangs.
    Metric(
        "parwatch_rank_up",
        _G,
        _R,
        "1 while a rank is alive (its activity, else its summaries within the grace period), 0 after",
    ),
    Metric(
        "parwatch_rank_state",
        _G,
        _R,
        "Rank state: 0 running, 1 hung, 2 gone, 3 unknown (its node's reports stopped)",
    ),
    Metric("parwatch_hang_detected", _G, (), "1 while a hang is named (a rank stuck while others wait on it)"),
    Metric(
        "parwatch_rank_straggler_seconds_total",
        _C,
        _R,
        "Straggler effect (DeepSpeed): this rank's collective time beyond each instance's shortest, i.e. its "
        "wait for later arrivals; the rank the others wait for has the least",
        "seconds",
    ),
    # Guardrails.
    Metric("parwatch_guardrail_state", _G, ("rule",), "Guardrail rule state: 0 ok, 1 pending, 2 firing"),
    Metric("parwatch_guardrail_actions_total", _C, ("rule", "action"), "Guardrail decisions that acted"),
    Metric("parwatch_run_paused", _G, (), "1 while the run is paused by a directive"),
    Metric(
        "parwatch_rank_transient_faults_total",
        _C,
        _R,
        "Steps with a non-finite value or a loss spike this rank produced that the re-run on the same "
        "microbatches did not reproduce (the check before the optimizer step): a flaky device or silent "
        "data corruption; two or more make the rank a suspect (the leader's count for the run)",
    ),
    Metric("parwatch_checkpoint_last_good_step", _G, (), "Newest step with a complete checkpoint"),
    # parwatch's own health.
    Metric(
        "parwatch_collector_overhead_ratio",
        _G,
        _R,
        "Share of the step the collector spent on the training thread",
        "ratio",
    ),
    Metric(
        "parwatch_ideal_step_seconds",
        _G,
        (),
        "ml-goodput-measurement's ideal step time: the mean of the steps of 1 s or more within median + 3 MAD "
        "(parwatch.goodput; absent while no step lasts 1 s)",
        "seconds",
    ),
    Metric(
        "parwatch_step_time_deviation_seconds",
        _G,
        (),
        "ml-goodput-measurement's step_time_deviation: p90 of the last 100 steps' |time - ideal|, less the "
        "median of the 1,000 before (their mean below 100 steps)",
        "seconds",
    ),
    Metric("parwatch_collector_dropped_summaries_total", _C, _R, "Summaries the rank's shipper dropped"),
    Metric(
        "parwatch_self_seconds_total",
        _C,
        ("rank", "part"),
        "parwatch's own time on this rank since its process started: span hooks and the collector on the training "
        "thread, the shipper's and the activity reporter's threads (CPU); rate() is the share of the rank's time",
        "seconds",
    ),
    Metric(
        "parwatch_time_seconds_total",
        _C,
        ("rank", "stage", "category"),
        "Where this rank's wall time went since its first process of the run started, one category per second "
        "(the goodput ledger, docs/goodput.md); the categories but wasted sum to that wall time, restarts' down "
        "time included",
        "seconds",
    ),
    Metric(
        "parwatch_tracker_points_written_total",
        _C,
        ("tracker",),
        "Points (a step's figures, or decisions) the leader wrote to an experiment tracker (--export)",
    ),
    Metric(
        "parwatch_tracker_points_dropped_total",
        _C,
        ("tracker",),
        "Points the leader did not write to an experiment tracker: it was slower than the run (its queue full, the "
        "oldest dropped) or failed (logged once per kind of failure)",
    ),
    Metric(
        "parwatch_sidecar_rules_reload_failures_total",
        _C,
        (),
        "Rules reloads refused because the file was invalid",
    ),
    Metric(
        "parwatch_posts_refused_total",
        _C,
        ("post", "reason"),
        "Posts this sidecar refused: its ranks' summaries (ingest) and activity, and node sidecars' digests "
        "(at the leader), by reason (unauthorized: missing or wrong credential; forbidden: a credential of another "
        "rank, node or run; invalid: a body or a claim that does not fit; conflict: another run, an earlier or "
        "another process; too_large; over_limit; unavailable: the state dir failed a write; bad_request)",
    ),
    Metric(
        "parwatch_leader_unreachable_since_timestamp_seconds",
        _G,
        (),
        "Unix time since which this node sidecar's ranks reach no leader (its digests fail or are refused, or "
        "it has no --leader-url in a larger run); 0 while they do, and at the leader",
        "seconds",
    ),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}
SERIES: dict[str, Metric] = {s: m for m in METRICS for s in m.series()}
"""Sample name (including _bucket/_sum/_count) -> its metric."""

SERIES_BUDGET_PER_RANK = 40
"""Most series one rank may add to a sidecar's /metrics (with a GPU; docs/deploy.md, "Series budget").

tests/unit/test_catalog.py's per_rank_series() is what the catalogue implies today (35 with a GPU, 30 without, 15 of them the goodput
ledger's per-category counters and 4 parwatch's own time by part; the step histogram,
16 series, is exported once per stage, not per rank); tests/unit/test_catalog.py counts a real /metrics
against this number, so a new per-rank series is a decision, not an accident.
"""


def metric(name: str) -> Metric:
    """The catalogue entry for a metric or sample name; KeyError naming the catalogue otherwise."""
    found = BY_NAME.get(name) or SERIES.get(name)
    if found is None:
        raise KeyError(f"{name} is not in the metric catalogue (parwatch/catalog.py); add it there first")
    return found


def family(cls, name: str):
    """An empty prometheus_client family of type `cls`, named, documented and labelled as the catalogue says."""
    m = metric(name)
    return cls(m.family, m.help, labels=list(m.labels))
