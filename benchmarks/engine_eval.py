"""GuardrailEngine.evaluate per step: 20 rules on the observations the sidecar builds.

    python benchmarks/engine_eval.py [--steps 2000] [--step-seconds 1.0] [--out benchmarks/results/engine_eval.json]

Rules: the packaged defaults plus variants over the known metrics (20 in all), with thresholds that
mostly pass; the observations carry noise, brief dips and spikes, so some rules go pending
and a few fire (alert decisions, each a synchronous=FULL commit and an fsync'd log append, are in
the timings). The
observation for N ranks has the sidecar's own shape (parwatch/sidecar/observations.py:
per-stage bubble series, per-rank rank_up and gpu_utilization_ratio, per-op collectives).

The engine's clock advances --step-seconds per step, and check_no_data runs once per
second of that clock, as the sidecar's ticker does (timed in its own columns). The engine
commits each evaluation's state itself (the sidecar commits in its writer thread instead), so
the timings include a SQLite commit (synchronous=NORMAL) per step. State lives in a temporary
directory on the file system of --state-root (fsync cost depends on it); the fsync columns count
Python's (decisions.jsonl), not SQLite's own.

Goal: evaluate with 20 rules <= 1 ms per step (p50), at 8 and at 1024 ranks.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import percentile, print_table, write_json  # noqa: E402

from parwatch.guardrails.engine import GuardrailEngine, Observation  # noqa: E402
from parwatch.guardrails.rules import Rule, RuleSet, default_rules  # noqa: E402
from parwatch.sidecar.observations import build_observation  # noqa: E402
from parwatch.sidecar.store import Store  # noqa: E402
from parwatch.wire.codec import parse  # noqa: E402
from parwatch.wire.steps import StepSummary  # noqa: E402
from tests.fixtures import synthetic as syn  # noqa: E402

GOAL_MS = 1.0
LAYOUTS = {8: (2, 4, 1), 1024: (8, 4, 32)}
"""ranks -> (tp, pp, dp)."""


def twenty_rules() -> RuleSet:
    """The packaged defaults and 13 alert-only variants (cooldown_steps defaults to 50)."""
    base = default_rules()
    variants = [
        Rule(name="loss-high", metric="loss", above=10.0),
        Rule(name="loss-spike-fast", metric="loss", check="spike", factor=1.5, window_steps=20, for_steps=2),
        Rule(name="bubble-high", metric="bubble_ratio", above=0.6),
        Rule(name="bubble-mean-high", metric="bubble_ratio", reduce="mean", above=0.5, for_steps=5),
        Rule(name="bubble-excess-warn", metric="bubble_excess_ratio", above=0.05, for_steps=3),
        Rule(name="skew-warn", metric="pipeline_skew_ratio", above=1.08, for_steps=5),
        Rule(name="step-slow", metric="step_seconds", above=1.05, for_steps=3),
        Rule(name="step-spike", metric="step_seconds", check="spike", factor=1.5, window_steps=50),
        Rule(
            name="collective-regression-fast",
            metric="collective_seconds_mean",
            check="regression",
            factor=1.5,
            window_steps=20,
            for_steps=2,
        ),
        Rule(name="collective-slow", metric="collective_seconds_mean", above=0.01),
        Rule(name="rank-missing-fast", metric="rank_up", reduce="min", below=1, for_steps=2),
        Rule(name="gpu-mean-low", metric="gpu_utilization_ratio", reduce="mean", below=0.6, for_steps=10),
        Rule(name="gpu-min-low", metric="gpu_utilization_ratio", reduce="min", below=0.3, for_steps=3),
    ]
    rules = base.rules + tuple(variants[: 20 - len(base.rules)])  # the defaults grow; 20 in all
    assert len(rules) == 20, len(rules)
    return RuleSet(
        rules=rules,
        enforce=base.enforce,
        max_rollbacks=base.max_rollbacks,
        rollback_window_steps=base.rollback_window_steps,
    )


def base_series(ranks: int) -> dict[str, dict[str, float]]:
    """The sidecar's own Observation.series for `ranks` ranks (store + build_observation)."""
    tp, pp, dp = LAYOUTS[ranks]
    store = Store(grace_seconds=1e9)
    stages = [syn.stage_view(s, 1.0, 0.7) for s in range(pp)]
    for r in range(ranks):
        s = syn.summary(r, 1, tp=tp, pp=pp, dp=dp, global_stages=stages if r == 0 else None)
        store.add(parse(s, StepSummary))
    return build_observation(store).series


class Observations:
    """Step-by-step variations of the base series: noise, and rare dips and spikes."""

    def __init__(self, series: dict[str, dict[str, float]], seed: int = 1):
        self.base, self.rng = series, random.Random(seed)
        ranks = list(series["rank_up"])
        gpu = series["gpu_utilization_ratio"]
        # Per-rank dicts are big: a pool of variants, chosen per step, keeps building them cheap.
        self.gpu_pool = [{k: 0.9 + self.rng.gauss(0, 0.03) for k in gpu} for _ in range(61)]
        self.gpu_pool[0][self.rng.choice(list(gpu))] = 0.2  # now and then one rank briefly starved
        self.rank_up_all = dict(series["rank_up"])
        self.rank_up_one_missing = {**self.rank_up_all, ranks[-1]: 0.0}

    def at(self, step: int, now: float) -> Observation:
        g, b = self.rng.gauss, self.base
        spike = 4.0 if step % 400 in (0, 1) else 1.0
        slow_link = 2.0 if step % 300 in (0, 1, 2) else 1.0
        series = {
            "loss": {"": 2.0 * (1 + 0.05 * g(0, 1)) * spike},
            "bubble_ratio": {k: v + g(0, 0.02) for k, v in b["bubble_ratio"].items()},
            "bubble_excess_ratio": {k: v + g(0, 0.02) for k, v in b["bubble_excess_ratio"].items()},
            "step_seconds": {"": 1.0 + g(0, 0.02)},
            "pipeline_skew_ratio": {"": 1.0 + abs(g(0, 0.03))},
            "rank_up": self.rank_up_one_missing if step % 500 in (0, 1, 2) else self.rank_up_all,
            "collective_seconds_mean": {
                k: v * (1 + 0.1 * abs(g(0, 1))) * slow_link for k, v in b["collective_seconds_mean"].items()
            },
            "gpu_utilization_ratio": self.gpu_pool[self.rng.randrange(len(self.gpu_pool))],
        }
        checkpoints = tuple(range(0, step, 100))
        return Observation(step=step, time=now, series=series, checkpoints=checkpoints)


class FsyncCounter:
    """Counts os.fsync calls (the log's appends) without changing what they do."""

    def __init__(self):
        self.count, self._real = 0, os.fsync

    def __call__(self, fd):
        self.count += 1
        return self._real(fd)


def run(ranks: int, steps: int, step_seconds: float, state_root: str | None) -> dict:
    observations = Observations(base_series(ranks))
    clock = [1_000_000.0]
    fsyncs = FsyncCounter()
    os.fsync = fsyncs
    try:
        with tempfile.TemporaryDirectory(dir=state_root) as state:
            engine = GuardrailEngine(twenty_rules(), state, now=lambda: clock[0])
            engine.begin_run("bench")  # as the sidecar does first: the state saved is a run's
            evaluate, tick = [], []
            decisions = fsync_evaluate = fsync_tick = 0
            next_tick = clock[0] + 1.0
            for step in range(1, steps + 1):
                clock[0] += step_seconds
                obs = observations.at(step, clock[0])
                before = fsyncs.count
                t0 = time.perf_counter()
                decisions += len(engine.evaluate(obs))
                evaluate.append(time.perf_counter() - t0)
                fsync_evaluate += fsyncs.count - before
                while clock[0] >= next_tick:  # the sidecar's 1 s ticker
                    before = fsyncs.count
                    t0 = time.perf_counter()
                    decisions += len(engine.check_no_data())
                    tick.append(time.perf_counter() - t0)
                    fsync_tick += fsyncs.count - before
                    next_tick += 1.0
            firing = sum(s["state"] != "ok" for s in engine.states().values())
            close = getattr(engine, "close", None)  # older engines have none
            if close is not None:
                close()
    finally:
        os.fsync = fsyncs._real
    ms = [t * 1e3 for t in evaluate]
    tick_ms = [t * 1e3 for t in tick] or [float("nan")]
    return {
        "ranks": ranks,
        "rules": 20,
        "steps": steps,
        "series": sum(len(v) for v in obs.series.values()),
        "evaluate_ms_p50": percentile(ms, 50),
        "evaluate_ms_p99": percentile(ms, 99),
        "evaluate_ms_mean": statistics.fmean(ms),
        "evaluate_ms_max": max(ms),
        "check_no_data_calls": len(tick),
        "check_no_data_ms_p50": percentile(tick_ms, 50),
        "check_no_data_ms_p99": percentile(tick_ms, 99),
        "fsyncs_in_evaluate_per_1000_steps": fsync_evaluate * 1000 / steps,
        "fsyncs_in_check_no_data_per_1000_steps": fsync_tick * 1000 / steps,
        "decisions": decisions,
        "rules_not_ok_at_end": firing,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--step-seconds", type=float, default=1.0, help="engine clock advance per step")
    ap.add_argument("--ranks", type=int, nargs="+", default=sorted(LAYOUTS), choices=sorted(LAYOUTS))
    ap.add_argument("--state-root", default=None, help="where the temporary state dir goes (default: TMPDIR)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/engine_eval.json"))
    a = ap.parse_args(argv)
    results = [run(r, a.steps, a.step_seconds, a.state_root) for r in a.ranks]
    print(
        f"GuardrailEngine.evaluate: 20 rules, {a.steps} steps of {a.step_seconds:g} s, "
        f"load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print_table(
        [
            "ranks",
            "rules",
            "series",
            "p50 ms",
            "p99 ms",
            "mean ms",
            "max ms",
            "tick p50 ms",
            "tick p99 ms",
            "eval fsyncs/1k steps",
            "tick fsyncs/1k steps",
            "decisions",
        ],
        [
            [
                r["ranks"],
                r["rules"],
                r["series"],
                r["evaluate_ms_p50"],
                r["evaluate_ms_p99"],
                r["evaluate_ms_mean"],
                r["evaluate_ms_max"],
                r["check_no_data_ms_p50"],
                r["check_no_data_ms_p99"],
                round(r["fsyncs_in_evaluate_per_1000_steps"]),
                round(r["fsyncs_in_check_no_data_per_1000_steps"]),
                r["decisions"],
            ]
            for r in results
        ],
    )
    goals = {f"evaluate_ms_p50_{r['ranks']}_ranks": [GOAL_MS, r["evaluate_ms_p50"] <= GOAL_MS] for r in results}
    print(
        "goal: p50 <= 1 ms per evaluate: "
        + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, (_, ok) in goals.items())
    )
    write_json(
        a.out,
        {
            "steps": a.steps,
            "step_seconds": a.step_seconds,
            "load_avg": os.getloadavg(),
            "results": results,
            "goals": goals,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
