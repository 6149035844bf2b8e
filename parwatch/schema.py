"""The wire contract between collectors, the sidecar and offline tools (version 1).

Everything that crosses a process boundary is described here once: the step
summary a collector produces per rank and step, the ingest request body, the
directive the sidecar hands back, and the JSONL files a run directory holds.

StepSummary (a dict; JSON object), one per rank and step:

    v                         1
    run_id                    str
    rank, stage, tp_rank, dp_rank         int
    tp, pp, dp, microbatches, chunks      int (chunks = v, model chunks per stage)
    schedule                  str, the schedule's name ("gpipe", "1f1b", "interleaved", or e.g. torch
                              pipelining's "ZBVZeroBubble"): letters, digits, _ . - (at most 64)
    step                      int, the optimizer step this summary describes (1-based)
    timeline                  int, rollbacks applied so far in this run: (run_id, rank, timeline, step)
                              names one summary, so a replayed step is not a retry
    time                      float, unix seconds when the step ended on this rank
    step_seconds              float, boundary-to-boundary period on this rank
    compute_seconds           float, forward + backward spans
    other_seconds             float, optimizer + DP gradient sync
    idle_seconds              float, step - compute - other
    bubble_ratio              float, idle / (idle + compute) = idle / (step - other) (parwatch.bubble)
    bubble_theoretical_ratio  float, (p-1)/(m+p-1) or (p-1)/(v*m+p-1); for schedules without a closed
                              form (zero-bubble, V shapes) the replay of the schedule's own actions at
                              equal action times (parwatch.bubble)
    loss                      float | null (NaN/inf encoded as the strings "nan", "inf", "-inf")
    tokens                    int, tokens the whole run consumed in this step (all DP replicas)
    memory_max_allocated_bytes  int | null
    model_flops_utilization_ratio  float, optional: only when the device's peak FLOP/s is configured
                              (--parwatch-peak-flops); model FLOPs of the step / (step_seconds * peak)
    collectives               list of {op, group, count, seconds, bytes, buckets, algbw, busbw}
                              buckets: cumulative counts for COLLECTIVE_BUCKETS (le), + "+Inf" = count
    gpu                       null | {index, utilization_ratio, memory_used_bytes, memory_total_bytes,
                                      power_watts, sm_clock_hertz, temperature_celsius, throttle_reasons}
    nvml_up                   0 | 1
    instances                 {host, data_seconds, groups, records, capped}: raw material of the sidecar's
                              wait/transfer split (parwatch/collector/instances.py, sidecar/transfer.py):
                              host str (ranks of one host share its monotonic clock); data_seconds float
                              (this step's data-fetch spans); groups {role: [global ranks]} of the collective
                              groups recorded; records: [op, group, seq, peer, start_us, dur_us, bytes] per
                              collective/p2p instance of a sampled step ([] otherwise; peer -1 for
                              collectives; seq the call's number on its group, or per direction and peer
                              for p2p); capped int (instances over the per-group budget, not recorded)
    overhead_seconds          float, time the collector itself spent on the training thread this step
    time_seconds              {category: float}, this rank's goodput ledger since its process started
                              (cumulative seconds per parwatch.vocabulary.TimeCategory; they sum to the
                              process's wall time at this boundary; parwatch/collector/ledger.py)
    process_start_time        float, unix seconds this rank's process started (a later one: the rank restarted)
    dropped_total             int, summaries this rank's shipper dropped so far
    checkpoints               list[int], steps with a complete checkpoint (rank 0; [] elsewhere)
    paused                    bool
    global                    rank 0 only, the fast-path view of the step before (one step of lag):
                              {step, loss, pipeline_skew_ratio, slowest_stage,
                               stages: [{stage, compute_seconds, idle_seconds, other_seconds,
                                         step_seconds, bubble_ratio, forward_seconds, backward_seconds,
                                         backward_weight_seconds, loss_seconds, ranks,
                                         bubble_schedule_ratio, bubble_imbalance_ratio, bubble_wait_ratio}]}
                              (each stage's figures: the mean over its `ranks` reporting ranks; the
                              three causes of its bubble when the trainer announced its pipeline order)

Ingest request (POST /v1/ingest):
    {"version": 1, "summaries": [StepSummary, ...], "outcomes": [OutcomeRecord, ...], "alive": bool}
    Summaries may be empty (rank 0 polling for a directive while the run is paused). Outcomes
    come from rank 0 alone and ride every post until one carrying them is accepted.
Ingest response: {"accepted": n, "directive": Directive | null}

Directive: {"id": int > 0, "action": "pause" | "resume" | "rollback", "run_id": str (the run it
            belongs to; a trainer of another run ignores it), "to_step": int | null (rollback:
            checkpoint step to load), "skip_batches": int >= 0 (rollback: data batches to skip
            after loading), "reason": str}

OutcomeRecord (what every rank did with one directive, counted in the step-boundary vector):
    {"directive_id", "run_id", "outcome": "applied" | "substituted" (a rollback loaded an older
     verified checkpoint than asked) | "failed" | "ignored" (another run's) | "mixed" (ranks differ),
     "step", "loaded_step": int | null, "counts": {outcome: ranks}, "reasons": {reason: ranks}, "ranks"}

Run directory files: summaries.jsonl (StepSummary per line), spans.jsonl (SpanRecord per
line, for the steps the collector samples), decisions.jsonl (sidecar decision records).

SpanRecord: {run_id, rank, stage, step, kind, start_s, end_s, attrs}
    start_s/end_s: seconds since the run's time origin (the first step boundary), so spans
    from different ranks on one host line up.
"""

from __future__ import annotations

from parwatch.vocabulary import CollectiveOp

SCHEMA_VERSION = 1

# Histogram upper bounds (seconds) for collective latency: 10 us .. 10 s, denser
# near the 1-50 ms range where TP all-reduces and p2p live and alert thresholds sit.
COLLECTIVE_BUCKETS = (
    1e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)

# Step duration histogram bounds (seconds).
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

from parwatch.contract.directives import ACTIONS as DIRECTIVE_ACTIONS  # noqa: E402,F401  (one definition, re-exported)


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor for an op over n ranks."""
    if n <= 1:
        return 1.0 if op in (CollectiveOp.SEND, CollectiveOp.RECV, CollectiveOp.BROADCAST) else 0.0
    if op == CollectiveOp.ALL_REDUCE:
        return 2 * (n - 1) / n
    if op in (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER):
        return (n - 1) / n
    return 1.0


def decode_float(x) -> float | None:
    """A number as the wire carries it (parwatch.vocabulary.jsonable writes NaN/inf as strings)."""
    if x is None:
        return None
    if isinstance(x, str):
        if x in ("nan", "inf", "-inf"):
            return float(x)
        raise ValueError(f"not a number: {x!r} (expected a number, 'nan', 'inf' or '-inf')")
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"not a number: {x!r}")
    return float(x)


# The activity report (parwatch.collector.activity -> parwatch.sidecar.activity_api), a rank's live state:
# its typed records are in parwatch/records.py.
HANG_EXIT_CODE = 75
"""Exit status of a rank the leader aborted for a hang (EX_TEMPFAIL): restart from the last checkpoint."""
MAX_TIME = 1e11
"""Largest unix time accepted (year 5138)."""


MAX_ERROR_CHARS = 200
"""A crashed rank's error text is cut to this many characters by the rank and checked by the sidecar."""


# How far a run can move: reports past these are refused, never taken as the run's newest state.
MAX_STEPS_PER_SECOND = 1000.0
"""Faster than any training run's steps: a summary or activity report that moves its rank further ahead of
the run's highest step than this pace allows since that step was first seen is refused (a forged step
10^9 would otherwise make every real rank look stalled behind it, or freeze the newest view)."""
MAX_TIMELINE = 100_000
"""Rollbacks applied in one run (a summary's timeline) at most."""
MAX_ROLLBACKS_PER_SECOND = 1.0
"""Faster than a run can load checkpoints: a timeline further ahead of the run's highest than this pace
allows since that timeline was first seen is refused (2^31 would otherwise stand as the newest forever)."""
