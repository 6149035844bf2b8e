"""Goodput and ETTR over the last minute at the sidecar (parwatch.sidecar.ledger_window), and a
guardrail rule on them: the summaries' ledgers -> the observation -> the engine -> a finding."""

from __future__ import annotations

import pytest

from parwatch.guardrails.engine import GuardrailEngine
from parwatch.guardrails.rules import Rule, RuleSet
from parwatch.sidecar.ledger_window import LedgerWindow
from parwatch.sidecar.observations import build_observation
from parwatch.sidecar.store import Store
from parwatch.wire.codec import parse
from parwatch.wire.steps import StepSummary
from tests.fixtures import synthetic as syn


def counters(productive, paused=0.0, startup=10.0, wasted=0.0):
    return {"productive": productive, "paused": paused, "startup": startup, "wasted": wasted}


def test_ratios_are_over_the_window_and_a_restarted_rank_counts_from_zero():
    window = LedgerWindow(seconds=60.0)
    window.add(0.0, {0: counters(0.0)})
    assert window.ratios() is None  # one point: nothing to difference yet
    window.add(30.0, {0: counters(30.0)})
    assert window.ratios() == {"goodput_ratio": pytest.approx(1.0), "ettr": pytest.approx(1.0)}
    window.add(90.0, {0: counters(60.0, paused=30.0)})  # the last minute: half of it paused
    assert window.ratios() == {"goodput_ratio": pytest.approx(0.5), "ettr": pytest.approx(0.5)}
    window.add(150.0, {0: counters(90.0, paused=30.0, wasted=30.0)})  # the next: productive, then discarded
    assert window.ratios()["goodput_ratio"] == pytest.approx(0.0)
    # The rank restarted: its counters went down. Against the point at 90 s they count from zero: its new
    # process's 5 s of start-up and 5 s of productive time.
    window.add(160.0, {0: counters(5.0, startup=5.0)})
    assert window.ratios() == {"goodput_ratio": pytest.approx(0.5), "ettr": pytest.approx(0.5)}


def test_an_ettr_rule_fires_on_a_run_that_spends_its_minute_paused(tmp_path):
    now = [1000.0]
    store = Store(clock=lambda: now[0])
    engine = GuardrailEngine(
        RuleSet(rules=(Rule(name="ettr-low", metric="ettr_ratio", below=0.5, for_steps=3, action="alert"),)),
        tmp_path,
        now=lambda: now[0],
    )
    engine.begin_run("synthetic")
    stages = [syn.stage_view(0, 1.0, 0.5), syn.stage_view(1, 1.0, 0.5)]
    paused = 0.0
    for step in range(1, 80):  # the last minute (steps 19-79) is 90% paused
        now[0] += 1.0
        paused += 0.9 if step > 10 else 0.0  # from step 11 each second is 90% paused
        for rank in range(2):
            s = syn.summary(rank, step, pp=2, global_stages=stages if rank == 0 else None)
            s["time_seconds"] = {**s["time_seconds"], "productive": step - paused, "paused": paused, "startup": 0.0}
            s["time_seconds"]["bubble_schedule"] = s["time_seconds"]["optimizer"] = 0.0
            store.add(parse(s, StepSummary))
        obs = build_observation(store)
        engine.evaluate(obs)
        if step == 10:
            assert obs.series["ettr_ratio"] == {"": pytest.approx(1.0)}
    assert obs.series["ettr_ratio"][""] == pytest.approx(0.1)
    assert engine.states()["ettr-low"]["state"] == "firing"
    [finding] = [d for d in engine.decisions(100) if d.get("rule") == "ettr-low"]
    assert finding["action"] == "alert"
