"""What the guardrail engine saves, and when (the Durability contract: engine.py, in full in docs/architecture.md).

A "crash" here is an engine dropped without close(): a new engine on the same state dir
must see everything the contract calls durable. The fast reducers and rolling medians the
engine uses per step are checked against their plain definitions at the end.
"""

import contextlib
import json
import math
import os
import random
import sqlite3
import statistics

import pytest

from parwatch.guardrails import engine_store as store
from parwatch.guardrails.checks import RegressionCheck, RollingWindow, Series
from parwatch.guardrails.engine import BASELINES_SAVE_SECONDS, GuardrailEngine, Observation
from parwatch.guardrails.rules import MIN_BASELINE_VALUES, Rule, RuleSet


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


class Fsyncs:
    """os.fsync, counting which files were synced (by inode)."""

    def __init__(self, monkeypatch):
        self.synced: list[int] = []
        real = os.fsync

        def fsync(fd):
            self.synced.append(os.fstat(fd).st_ino)
            return real(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    def of(self, path) -> int:
        return self.synced.count(os.stat(path).st_ino)


def skew_rule(**kw):
    return Rule(
        **{
            "name": "skew",
            "metric": "pipeline_skew_ratio",
            "above": 1.25,
            "for_steps": 5,
            "cooldown_steps": 10,
            "action": "alert",
            **kw,
        }
    )


def nan_rule(**kw):
    return Rule(**{"name": "nan", "metric": "loss", "check": "finite", "action": "rollback", "cooldown_steps": 1, **kw})


def spike_rule():
    return Rule(name="spike", metric="loss", check="spike", factor=3.0, window_steps=10, action="alert")


class Run:
    """An engine fed one step at a time; the clock stands still unless a test moves it."""

    def __init__(self, state_dir, *rules, clock=None):
        self.dir, self.rules = state_dir, RuleSet(rules=rules)
        self.clock = clock or Clock()
        self.engine = GuardrailEngine(self.rules, state_dir, now=self.clock)
        self.engine.begin_run("r")
        self.step = 0

    def feed(self, checkpoints=(), **series):
        self.step += 1
        obs = Observation(self.step, self.clock.t, {m: {"": v} for m, v in series.items()}, tuple(checkpoints))
        return self.engine.evaluate(obs)

    def restarted(self) -> GuardrailEngine:
        """A new engine on the same state dir, as after a crash (the old one is not closed)."""
        return GuardrailEngine(self.rules, self.dir, now=self.clock)


def test_a_state_transition_is_on_disk_at_once(tmp_path):
    run = Run(tmp_path, skew_rule())
    run.feed(pipeline_skew_ratio=1.0)
    run.feed(pipeline_skew_ratio=1.5)  # ok -> pending
    st = run.restarted().states()["skew"]
    assert (st["state"], st["failing_steps"], st["since_step"]) == ("pending", 1, 2)
    for _ in range(4):
        run.feed(pipeline_skew_ratio=1.5)  # the 5th failing step: firing, and an alert decision
    again = run.restarted()
    assert again.states()["skew"]["state"] == "firing"
    assert [d["rule"] for d in again.decisions()] == ["skew"]


def test_counters_are_saved_with_every_evaluation(tmp_path):
    run = Run(tmp_path, skew_rule(), spike_rule())
    for _ in range(3):
        run.feed(pipeline_skew_ratio=1.5, loss=2.0)
    assert run.restarted().states()["skew"]["failing_steps"] == 3  # a crash keeps every counter
    run.feed(pipeline_skew_ratio=1.5, loss=2.0)
    run.engine.close()  # the baseline windows too
    again = run.restarted()
    assert again.states()["skew"]["failing_steps"] == 4
    # The spike baseline came along: 4 values saved + 1 more make a baseline to judge by.
    assert again.evaluate(Observation(5, run.clock.t, {"loss": {"": 2.0}})) == []
    (spike,) = again.evaluate(Observation(6, run.clock.t, {"loss": {"": 7.0}}))
    assert spike["rule"] == "spike" and spike["evidence"]["baseline"] == 2.0


def saved(state_dir, sql, *args):
    """The rows of a query (or a change, committed) on the store."""
    with contextlib.closing(sqlite3.connect(state_dir / "parwatch.db")) as db, db:
        return db.execute(sql, args).fetchall()


def saved_windows(state_dir, rule, run_id="r"):
    (row,) = saved(state_dir, "SELECT windows FROM baselines WHERE run_id = ? AND rule = ?", run_id, rule)
    return json.loads(row[0])["history"]


def test_baselines_are_saved_apart_from_the_state_and_at_most_a_minute_stale(tmp_path):
    """The spike and regression windows are saved once BASELINES_SAVE_SECONDS passed (not with the counters
    at every step); a crash loses at most that long of them, nothing else."""
    run = Run(tmp_path, spike_rule())
    for _ in range(4):
        run.feed(loss=2.0)
    run.engine.close()  # close saves them
    ((state,),) = saved(tmp_path, "SELECT state FROM rules WHERE rule = 'spike'")
    assert "history" not in json.loads(state)  # the state saved every step stays small
    assert saved_windows(tmp_path, "spike") == {"values": [2.0] * 4}
    for _ in range(3):
        run.clock.t += 1.0
        run.feed(loss=3.0)
    assert run.restarted().states()["spike"]["last_value"] == 3.0
    assert saved_windows(tmp_path, "spike") == {"values": [2.0] * 4}
    run.clock.t += BASELINES_SAVE_SECONDS
    run.feed(loss=3.0)
    again = run.restarted()  # a crash: the windows as of the last minute's save
    assert again.policy.monitors["spike"].check.history() == {"values": [2.0] * 4 + [3.0] * 4}


def test_a_garbled_rule_row_costs_that_rule_not_the_start(tmp_path, caplog):
    run = Run(tmp_path, spike_rule(), skew_rule())
    for _ in range(4):
        run.feed(loss=2.0, pipeline_skew_ratio=1.5)
    run.engine.close()
    saved(tmp_path, "UPDATE baselines SET windows = ? WHERE rule = 'spike'", '{"history": {"values": [1, "x"]}')
    saved(tmp_path, "UPDATE rules SET state = '[1' WHERE rule = 'skew'")
    again = run.restarted()
    assert again.policy.monitors["spike"].check.history() == {"values": []}
    assert "a row of table baselines is unreadable" in caplog.text  # moved to rows_aside, an ERROR each
    assert "a row of table rules is unreadable (state='[1'" in caplog.text
    assert again.states()["skew"]["failing_steps"] == 0
    assert again.states()["spike"]["last_value"] == 2.0  # the rest of the state is kept


def test_a_new_run_keeps_the_old_runs_rows_archived(tmp_path):
    run = Run(tmp_path, spike_rule())
    for _ in range(4):
        run.feed(loss=2.0)
    run.engine.begin_run("next")
    assert saved_windows(tmp_path, "spike") == {"values": [2.0] * 4}
    assert run.engine.policy.monitors["spike"].check.history() == {"values": []}
    runs = saved(tmp_path, "SELECT run_id, archived_at IS NOT NULL, tick FROM runs ORDER BY run_id")
    assert runs == [("next", 0, 0), ("r", 1, 4)]  # archiving is a query: the rows stay
    assert run.restarted().run_id == "next"


def test_every_record_is_fsynced_on_append(tmp_path, monkeypatch):
    run = Run(tmp_path, nan_rule())
    run.feed(loss=1.0, checkpoints=(0,))
    # Counted from here: files are told apart by inode.
    fsyncs = Fsyncs(monkeypatch)
    log = tmp_path / "decisions.jsonl"
    (record,) = run.feed(loss=math.nan, checkpoints=(0,))  # a rule's rollback
    assert fsyncs.of(log) == 1
    run.engine.request("pause", "operator")
    assert fsyncs.of(log) == 2
    applied(run.engine, record["directive_id"])  # an "applied" record
    assert fsyncs.of(log) == 3
    assert len(log.read_text().splitlines()) == 3


def test_what_each_commit_syncs(tmp_path):
    """Counters and rule states commit with synchronous=NORMAL (no fsync: a process crash keeps them); a
    decision, a delivery and an outcome with FULL (the WAL fsync'd: a power loss keeps them too)."""
    run = Run(tmp_path, skew_rule(), nan_rule())
    run.engine.defer_writes()

    def committed() -> str:
        """How the owed batch committed: its synchronous level as SQLite reports it."""
        run.engine.take_writes().write()
        (level,) = run.engine._store._db.execute("PRAGMA synchronous").fetchone()
        return {1: "NORMAL", 2: "FULL"}[level]

    run.feed(pipeline_skew_ratio=1.0, loss=1.0, checkpoints=(0,))
    assert committed() == "NORMAL"
    run.feed(pipeline_skew_ratio=1.5, loss=1.0, checkpoints=(0,))  # ok -> pending
    assert committed() == "NORMAL"
    (rollback,) = run.feed(pipeline_skew_ratio=1.5, loss=math.nan, checkpoints=(0,))
    assert committed() == "FULL"
    run.engine.pending_directive(deliver=True)  # from now on it cannot be cancelled
    assert committed() == "FULL"
    run.engine.pending_directive(deliver=True)
    assert not run.engine.take_writes()  # delivered once
    applied(run.engine, rollback["directive_id"])
    assert committed() == "FULL"
    assert run.restarted().pending_directive() is None


def test_a_crash_between_a_commit_and_its_log_append_is_repaired_at_the_next_start(tmp_path, monkeypatch):
    run = Run(tmp_path, skew_rule())
    run.engine.request("pause", "operator")

    def killed(path, lines):
        with open(path, "ab") as f:
            f.write(lines[0][:12])  # a line cut short, then nothing: the kill

    monkeypatch.setattr(store, "append_lines", killed)
    run.engine.request("resume", "operator")  # committed, its line cut short
    monkeypatch.undo()
    run.restarted()
    lines = (tmp_path / "decisions.jsonl").read_text().splitlines()
    assert lines[1] == '{"type":"dec' and [json.loads(line)["id"] for line in lines[::2]] == [1, 2]
    run.restarted()  # nothing more to add
    assert len((tmp_path / "decisions.jsonl").read_text().splitlines()) == 3


def applied(engine, directive_id, step=2, ranks=2):
    return engine.record_outcome(
        {
            "directive_id": directive_id,
            "run_id": "r",
            "outcome": "applied",
            "step": step,
            "counts": {"applied": ranks},
            "ranks": ranks,
        }
    )


def test_restart_after_a_crash_keeps_states_and_directives(tmp_path):
    run = Run(tmp_path, skew_rule(), nan_rule())
    run.feed(pipeline_skew_ratio=1.5, loss=1.0, checkpoints=(0,))
    (rollback,) = run.feed(pipeline_skew_ratio=1.5, loss=math.nan, checkpoints=(0,))
    pause = run.engine.request("pause", "operator")
    run.feed(pipeline_skew_ratio=1.5, loss=math.nan, checkpoints=(0,))  # counters only

    again = run.restarted()  # no close(): a crash
    states = again.states()
    assert (states["skew"]["state"], states["skew"]["failing_steps"]) == ("pending", 3)
    assert states["nan"]["state"] == "firing"
    assert again.run_id == "r"
    assert again.pending_directive()["id"] == rollback["directive_id"]
    applied(again, rollback["directive_id"])
    assert again.pending_directive()["id"] == pause["directive_id"]
    applied(again, pause["directive_id"])
    assert again.paused and again.pending_directive() is None
    assert again.request("resume", "operator")["id"] == 3  # ids continue


def test_an_outcome_is_durable_before_the_call_returns(tmp_path, monkeypatch):
    run = Run(tmp_path, skew_rule())
    run.feed(pipeline_skew_ratio=1.0)
    pause = run.engine.request("pause", "operator")["directive_id"]
    fsyncs = Fsyncs(monkeypatch)
    applied(run.engine, pause)
    assert fsyncs.of(tmp_path / "decisions.jsonl") == 1
    assert run.restarted().paused


# -- the per-step fast paths agree with the plain definitions -----------------------------------------


def plain_reduce(values, how):
    usable = {k: v for k, v in values.items() if not math.isnan(v)}
    if not usable:
        return math.nan, None
    if how == "mean":
        return sum(usable.values()) / len(usable), None
    pick = max if how == "max" else min
    key = pick(sorted(usable), key=lambda k: usable[k])
    return usable[key], key


def same(a, b):
    return (math.isnan(a[0]) and math.isnan(b[0]) or a[0] == b[0]) and a[1] == b[1]


@pytest.mark.parametrize("how", ["max", "min", "mean"])
def test_series_reduce_matches_the_plain_definition(how):
    rng = random.Random(7)
    pool = [0.0, 1.0, 1.0, 0.5, -0.0, math.nan, math.inf, -math.inf, 2.5]
    for _ in range(2000):
        n = rng.randrange(0, 7)
        values = {f"rank={rng.randrange(20)}": rng.choice(pool + [rng.random()]) for _ in range(n)}
        assert same(Series(values).reduce(how), plain_reduce(values, how)), values
    every_rank_up = {f"rank={r}": 1.0 for r in range(1024)}
    assert Series(every_rank_up).reduce("min") == (1.0, "rank=0")


def test_rolling_window_median_matches_statistics_median():
    rng = random.Random(3)
    window = RollingWindow(7)
    recent = []
    for _ in range(500):
        value = rng.choice([rng.random(), 1.0, 2.0])
        window.append(value)
        recent = (recent + [value])[-7:]
        assert window.median() == statistics.median(recent) and window.to_list() == recent
    restored = RollingWindow(3)
    restored.extend(["1.5", 2, float("nan"), 4.0, 8.0])  # as read back from the store; NaN never enters
    assert restored.to_list() == [2.0, 4.0, 8.0] and restored.median() == 4.0


@pytest.mark.parametrize("window_steps", [2, 4, 7])
def test_regression_read_matches_the_plain_definition(window_steps):
    """Each series' ratio to the median of its own previous window_steps finite values (judged once
    it has min(MIN_BASELINE_VALUES, window) of them and the median is positive), reduced by max."""
    rng = random.Random(window_steps)
    check = RegressionCheck(
        Rule(
            name="r",
            metric="collective_transfer_seconds",
            check="regression",
            factor=2.0,
            window_steps=window_steps,
            action="alert",
        )
    )
    past: dict[str, list[float]] = {}
    for _ in range(300):
        values = {
            f"path={rng.randrange(6)}": rng.choice([0.0, 1.0, 2.0, math.nan, math.inf, rng.random()])
            for _ in range(rng.randrange(0, 5))
        }
        ratios, medians = {}, {}
        for key, value in values.items():
            if not math.isfinite(value):
                continue
            earlier = past.setdefault(key, [])
            if len(earlier) >= min(MIN_BASELINE_VALUES, window_steps) and statistics.median(earlier) > 0:
                medians[key] = statistics.median(earlier)
                ratios[key] = value / medians[key]
            past[key] = (earlier + [value])[-window_steps:]
        reading = check.read(Series(values))
        if not ratios:
            assert reading is None
            continue
        value, key = plain_reduce(ratios, "max")
        assert (reading.value, reading.series, reading.baseline) == (value, key, medians[key])
        assert reading.failing == (value > 2.0)
