"""A run's measured bubble per step against the replay of its schedule at that step's measured
times (parwatch.pipeline_sim.timings_from_spans), read from the run's summaries.jsonl and
spans.jsonl. Shared by the integration's and the reference trainer's fidelity tests."""

from __future__ import annotations

import json
import os

from parwatch import pipeline_sim as ps


def replayed_steps(run_dir: str, order) -> dict:
    """step -> (measured {rank: bubble}, the replay at the step's measured times, host {rank: s}, p2p_s),
    for the steps >= 2 whose spans were kept (the previous boundary's end opens a step's period)."""
    measured: dict = {}
    with open(os.path.join(run_dir, "summaries.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            measured.setdefault(row["step"], {})[row["rank"]] = row["bubble_ratio"]
    spans: dict = {}
    with open(os.path.join(run_dir, "spans.jsonl")) as f:
        for line in f:
            span = json.loads(line)
            spans.setdefault(span["step"], []).append(span)
    out = {}
    for step in sorted(spans):
        opened = {s["rank"]: s["end_s"] for s in spans.get(step - 1, ()) if s["kind"] == "boundary"}
        if step < 2 or set(opened) != set(order):
            continue
        durations, host, p2p = ps.timings_from_spans(order, spans[step], opened)
        out[step] = (measured[step], ps.simulate(order, durations, p2p_s=p2p, host_s=host), host, p2p)
    return out
