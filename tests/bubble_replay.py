"""A run's measured bubble per step against the replay of its schedule at that step's measured
times (`timings_from_spans`), read from the run's summaries.jsonl and spans.jsonl. Shared by the
integration's and the reference trainer's fidelity tests."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Mapping

from parwatch import pipeline_sim as ps
from parwatch.contract import COMPUTE_KINDS, OTHER_KINDS, SpanKind
from parwatch.pipeline_sim import Action, B, F, I, Replay, W, stages_of
from parwatch.vocabulary import P2PPayload


def replayed_steps(run_dir: str, order, ranks: Mapping[int, int] | None = None) -> dict:
    """step -> (measured {rank: bubble}, the replay at the step's measured times, host {rank: [s per block]},
    p2p_s),
    for the steps >= 2 whose spans were kept (the previous boundary's end opens a step's period).
    ranks: {rank of `order`: the run's rank that ran it}, for one pipeline of a run with several (a DP
    replica, a TP rank); the others' records are left out. Default: the order's ranks are the run's."""
    ours = {run_rank: rank for rank, run_rank in (ranks or {r: r for r in order}).items()}
    measured: dict = {}
    with open(os.path.join(run_dir, "summaries.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if row["rank"] in ours:
                measured.setdefault(row["step"], {})[ours[row["rank"]]] = row["bubble_ratio"]
    spans: dict = {}
    with open(os.path.join(run_dir, "spans.jsonl")) as f:
        for line in f:
            span = json.loads(line)
            if span["rank"] in ours:
                spans.setdefault(span["step"], []).append({**span, "rank": ours[span["rank"]]})
    out = {}
    for step in sorted(spans):
        opened = {s["rank"]: s["end_s"] for s in spans.get(step - 1, ()) if s["kind"] == "boundary"}
        if step < 2 or set(opened) != set(order):
            continue
        durations, host, p2p, p2p_of = timings_from_spans(order, spans[step], opened)
        # The ranks' periods open 1-8 ms apart (each at its own boundary's end): a rank that opened
        # later starts its first block later, on the replay's one clock.
        late = {rank: at - min(opened.values()) for rank, at in opened.items()}
        shifted = {rank: [blocks[0] + late[rank], *blocks[1:]] for rank, blocks in host.items()}
        replay = ps.simulate(order, durations, p2p_s=p2p, host_s=shifted, p2p_of=p2p_of)
        tail, other = tail_seconds(spans[step]), other_before_last(spans[step], opened)
        out[step] = (measured[step], with_tail(replay, tail, late, other), host, p2p)
    return out


def tail_seconds(spans) -> dict[int, float]:
    """{rank: seconds of its step period after the pipeline's last compute ended (on any rank), in
    neither compute nor other work}: the framework's step end (the loss broadcast, waits around the
    optimizer, the step boundary). The bubble counts it as idle; the schedule does not make it."""
    last = max(s["end_s"] for s in spans if s["kind"] in COMPUTE_KINDS)
    tails = {}
    for s in spans:
        if s["kind"] == SpanKind.BOUNDARY:
            rank, end = s["rank"], s["end_s"]
            other = [(o["start_s"], o["end_s"]) for o in spans if o["rank"] == rank and o["kind"] in OTHER_KINDS]
            tails[rank] = max(0.0, (end - last) - _covered(other, last, end))
    return tails


def other_before_last(spans, opened: Mapping[int, float]) -> dict[int, float]:
    """{rank: seconds of other work (optimizer, gradient sync, ...) between its period's start and the
    pipeline's last compute}: time the collector's bubble leaves out (other, not idle) where the replay,
    which runs compute only, has the rank idle. A last stage's DP gradient sync while the first stage
    still drains is one (Megatron with DP > 1: 1-16 ms a step, before the first stage's last backward)."""
    last = max(s["end_s"] for s in spans if s["kind"] in COMPUTE_KINDS)
    other: dict[int, list] = {}
    for s in spans:
        if s["kind"] in OTHER_KINDS:
            other.setdefault(s["rank"], []).append((s["start_s"], s["end_s"]))
    return {rank: _covered(other.get(rank, []), start, last) for rank, start in opened.items()}


def with_tail(
    replay: ps.SimResult,
    tail: Mapping[int, float],
    late: Mapping[int, float] | None = None,
    other: Mapping[int, float] | None = None,
) -> ps.SimResult:
    """The replay over each rank's whole period: its measured tail (`tail_seconds`) added as idle, so
    the replayed bubble is what the collector's formula gives at the schedule's makespan. late: {rank:
    seconds its period opened after the first rank's}; the replay ran them as idle, its period did not.
    other: {rank: other work inside the replay's span (`other_before_last`)}: out of its idle and period,
    as the collector leaves it out."""
    bubble = {}
    for rank, idle in replay.idle.items():
        extra, before = tail.get(rank, 0.0), (late or {}).get(rank, 0.0)
        inside = (other or {}).get(rank, 0.0)
        period = replay.makespan - before + extra - inside
        bubble[rank] = (idle - before + extra - inside) / period if period > 0 else 0.0
    return dataclasses.replace(replay, bubble=bubble)


def assert_near_replay(steps: dict, label: str, tolerance: float) -> dict[int, float]:
    """Print each step's measured - replayed bubble per rank (`replayed_steps`' output), and assert every
    rank's median step within `tolerance` of the replay; returns {rank: median deviation}."""
    ranks = sorted(next(iter(steps.values()))[0]) if steps else []
    print(f"\n{label}: measured - replayed bubble per step (host ms per block, mean; p2p ms)")
    for step, (measured, replay, host, p2p) in steps.items():
        print(
            f"  step {step}: "
            + "  ".join(
                f"rank {r} {measured[r] - replay.bubble[r]:+.4f} ({statistics.fmean(host[r]) * 1e3:.2f})" for r in ranks
            )
            + f"  p2p {p2p * 1e3:.2f}"
        )
    medians = {
        r: statistics.median(measured[r] - replay.bubble[r] for measured, replay, _, _ in steps.values()) for r in ranks
    }
    print("  median step: " + "  ".join(f"rank {r} {d:+.4f}" for r, d in medians.items()))
    for rank, deviation in medians.items():
        assert abs(deviation) <= tolerance, f"{label} rank {rank}: median step {deviation:+.4f} off the replay"
    return medians


_SPAN_TYPES = {SpanKind.FORWARD: F, SpanKind.BACKWARD: B, SpanKind.BACKWARD_INPUT: I, SpanKind.BACKWARD_WEIGHT: W}
# Not the executor's host work: compute (loss included), waiting on a neighbour's data (idle the
# schedule explains) and work that is not the pipeline's (optimizer, gradient sync, data, checkpoint).
_NOT_HOST_KINDS = COMPUTE_KINDS | OTHER_KINDS | {SpanKind.RECV}


def timings_from_spans(order: Mapping, spans, period_start: Mapping[int, float]) -> tuple[dict, dict, float, dict]:
    """One measured step as `simulate` inputs: `(durations {Action: s}, host_s, p2p_s, p2p_of)`.

    spans: the step's span records of every rank, as the collector writes them to spans.jsonl
        (rank, kind, start_s, end_s, attrs with microbatch and vstage, or chunk: the rank's
        chunk-th virtual stage of `order`), on one clock.
    period_start: {rank: where the step's period began (the previous boundary's end)}.
    A loss span is added to its stage's forward (torch computes the loss right after it).
    host_s: {rank: [seconds per executor block]}: what the rank spent, from the end of the block
    before (or its period start) to the block's last compute span, neither computing nor blocked in
    a receive nor in other work (optimizer, gradient sync, data, checkpoint): the runtime's own
    cost before each action, where it fell (one slow hand-off delays what follows it, not the
    step evenly).
    p2p_s: the median, over the receives that waited for their data, of the wait's end minus
    the end of the action that produced the data on the other rank (posting the send, the
    transfer, waking the receiver); 0 when no receive waited.
    p2p_of: {producing Action: s} for every receive of the step: its end minus the end of the
    producer's block (an `Overlap` sends what it produced when the whole block ends).
    The data had arrived by then; where it came late (a send posted after other instructions, as
    DeepSpeed's are, or a rank waiting for a core) the replay waits as the rank did. On a 2-core
    machine with 4 ranks these were 0.3-22 ms, against a median of 1.2 ms."""
    blocks = Replay(order).blocks
    stages = stages_of(order)
    by_rank: dict[int, list] = {}
    for span in spans:
        by_rank.setdefault(span["rank"], []).append(span)
    durations: dict[Action, float] = {}
    host: dict[int, list[float]] = {}
    published: dict[Action, float] = {}  # where an action's block ended: the replay sends its output then
    for rank, groups in blocks.items():
        if rank not in period_start:
            raise ValueError(f"period_start lacks rank {rank}: give every rank's step start")
        block_of = {action: k for k, group in enumerate(groups) for action in group}
        records = sorted(by_rank.get(rank, []), key=lambda r: r["start_s"])
        busy = [r for r in records if r["kind"] in COMPUTE_KINDS]
        if not busy:
            raise ValueError(f"rank {rank} has no compute spans in this step")
        block_end = [period_start[rank]] * len(groups)
        for r in busy:
            attrs = r["attrs"]
            vstage = attrs["vstage"] if "vstage" in attrs else stages[rank][attrs["chunk"]]
            action = Action(vstage, _SPAN_TYPES.get(r["kind"], F), attrs["microbatch"])  # loss: F
            durations[action] = durations.get(action, 0.0) + (r["end_s"] - r["start_s"])
            if action in block_of:
                block_end[block_of[action]] = max(block_end[block_of[action]], r["end_s"])
        not_host = [(r["start_s"], r["end_s"]) for r in records if r["kind"] in _NOT_HOST_KINDS]
        host[rank], since = [], period_start[rank]
        for end in block_end:
            end = max(end, since)
            host[rank].append(max(0.0, (end - since) - _covered(not_host, since, end)))
            since = end
        published.update((action, block_end[k]) for action, k in block_of.items())
    missing = sorted({str(a) for g in blocks.values() for b in g for a in b} - {str(a) for a in durations})
    if missing:
        raise ValueError(f"no span for actions {', '.join(missing[:5])}: the spans do not cover the order")
    return durations, host, *_p2p_latency(order, spans, stages, published)


def _p2p_latency(order: Mapping, spans, stages: Mapping[int, list], published: Mapping) -> tuple[float, dict]:
    ends: dict = {}  # (stage, "F" | "B", microbatch) -> end of the compute span producing that output
    for r in spans:
        if r["kind"] in _SPAN_TYPES and _SPAN_TYPES[r["kind"]] != W:
            attrs = r["attrs"]
            vstage = attrs["vstage"] if "vstage" in attrs else stages[r["rank"]][attrs["chunk"]]
            ends[(vstage, F if r["kind"] == SpanKind.FORWARD else B, attrs["microbatch"])] = r["end_s"]
    latencies, arrivals = [], {}
    for r in spans:
        if r["kind"] != SpanKind.RECV or r["attrs"].get("what") not in (P2PPayload.ACTIVATION, P2PPayload.GRAD):
            continue
        attrs = r["attrs"]
        vstage = attrs["vstage"] if "vstage" in attrs else stages[r["rank"]][attrs["chunk"]]
        key = (
            (vstage - 1, F, attrs["microbatch"])
            if attrs["what"] == P2PPayload.ACTIVATION
            else (vstage + 1, B, attrs["microbatch"])
        )
        produced = ends.get(key)
        if produced is None:
            continue
        if r["start_s"] < produced:  # it waited: its end is the data's arrival
            latencies.append(max(0.0, r["end_s"] - produced))
        # The producer as the order names it (a zero-bubble schedule's input gradient is I, not B).
        producer = next((a for a in (Action(*key), Action(key[0], I, key[2])) if a in published), None)
        if producer is not None:
            latency = max(0.0, r["end_s"] - published[producer])
            arrivals[producer] = max(latency, arrivals.get(producer, 0.0))  # TP: every receiver had it
    latencies.sort()
    return (latencies[len(latencies) // 2] if latencies else 0.0), arrivals


def _covered(intervals, lo: float, hi: float) -> float:
    """Seconds of [lo, hi] inside the union of `intervals`."""
    total, reach = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            total += b - a
            reach = b
    return total


def median_causes(run_dir: str, order) -> dict:
    """`pipeline_sim.bubble_causes` of a run: each rank's median time per action type and its median
    bubble over steps >= 2 (one action stalled by a loaded machine moves a mean or a minimum, not a
    median). Shared by the framework integrations' tests."""
    samples: dict = {}
    with open(os.path.join(run_dir, "spans.jsonl")) as f:
        for line in f:
            span = json.loads(line)
            kind = _SPAN_TYPES.get(span["kind"])
            if kind is not None and span["step"] >= 2:
                samples.setdefault(span["rank"], {}).setdefault(kind, []).append(span["end_s"] - span["start_s"])
    times = {rank: {kind: statistics.median(v) for kind, v in kinds.items()} for rank, kinds in samples.items()}
    bubbles: dict = {}
    with open(os.path.join(run_dir, "summaries.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if row["step"] >= 2:
                bubbles.setdefault(row["rank"], []).append(row["bubble_ratio"])
    return ps.bubble_causes(order, times, {rank: statistics.median(v) for rank, v in bubbles.items()})
