"""The demo's pieces without running it: trainer arguments, the summaries tail, the live
line, the closing summary (on the synthetic run directory) and the process-group scan."""

from __future__ import annotations

import json
import os

import pytest
from rich.console import Console

from parwatch.bubble import closed_form
from parwatch.demo.live import SummaryTail, status_line
from parwatch.demo.processes import live_group_members
from parwatch.demo.runner import pause_hint
from parwatch.demo.scenario import SCENARIOS, DemoConfig
from parwatch.demo.summary import build_summary, print_summary
from parwatch.trainer.config import parse_args
from parwatch.trainer.faults import parse_fault
from tests.fixtures.make_run_dir import make_run_dir


def trainer_config(cfg: DemoConfig, tmp_path):
    """What the trainer itself makes of the demo's arguments (its parser and its checks)."""
    tc = parse_args([*cfg.trainer_args(), "--checkpoint-dir", str(tmp_path / "ckpt")])
    tc.validate(tc.nproc)
    return tc


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_trainer_args_are_a_valid_tp2_pp2_trainer_command(scenario, tmp_path):
    cfg = DemoConfig(steps=12, scenario=scenario, microbatches=6, schedule="gpipe")
    tc = trainer_config(cfg, tmp_path)
    assert (tc.nproc, tc.tp, tc.pp, tc.dp) == (4, 2, 2, 1)
    assert (tc.steps, tc.microbatches, tc.schedule) == (12, 6, "gpipe")
    assert tc.checkpoint_every >= 1
    assert len(tc.inject) == (0 if scenario == "none" else 1)


def test_no_fault_without_a_scenario():
    assert DemoConfig(steps=40).inject_args() == []


@pytest.mark.parametrize("steps", [2, 3, 8, 14, 40, 101])
def test_nan_lands_mid_run_with_a_checkpoint_before_it(steps, tmp_path):
    cfg = DemoConfig(steps=steps, scenario="nan")
    tc = trainer_config(cfg, tmp_path)
    fault = parse_fault(tc.inject[0])
    assert fault.kind == "nan"
    nan_step = fault.params["step"]
    assert 2 <= nan_step <= steps  # inside the run, never the first step
    assert nan_step >= steps // 2  # mid-run, so the live view shows it happen
    # The newest checkpoint before the NaN step is the rollback's target: it must exist,
    # or the sidecar can only pause (and the demo would wait for a resume forever).
    saved = [s for s in range(1, steps + 1) if s % tc.checkpoint_every == 0]
    assert any(s < nan_step for s in saved)


def test_nan_scenario_keeps_the_configured_interval_when_it_already_fits():
    assert DemoConfig(steps=40, scenario="nan", checkpoint_every=5).checkpoint_interval() == 5
    assert DemoConfig(steps=40, scenario="none", checkpoint_every=7).checkpoint_interval() == 7


@pytest.mark.parametrize("steps", [2, 8, 40])
def test_straggler_slows_stage_1_from_mid_run(steps, tmp_path):
    cfg = DemoConfig(steps=steps, scenario="straggler", straggler_ms=55)
    fault = parse_fault(trainer_config(cfg, tmp_path).inject[0])
    assert fault.kind == "straggler"
    assert fault.params["stage"] == 1 and fault.params["ms"] == 55
    assert 2 <= fault.params["from_step"] <= steps


def summary_line(rank, step, stage, bubble=0.25, loss=None, glob=None):
    return json.dumps(
        {
            "rank": rank,
            "stage": stage,
            "step": step,
            "bubble_ratio": bubble,
            "bubble_theoretical_ratio": 0.2,
            "loss": loss,
            "global": glob,
        }
    )


def view(*bubbles):
    """Rank 0's fast-path view with these stage bubbles."""
    return {"step": 0, "stages": [{"stage": s, "bubble_ratio": b} for s, b in enumerate(bubbles)]}


def test_tail_reads_only_complete_lines_and_keeps_the_rest_for_later(tmp_path):
    path = tmp_path / "summaries.jsonl"
    tail = SummaryTail(path)
    assert tail.poll() is False  # no file yet: nothing, and no error
    first = summary_line(0, 1, 0, loss=4.5, glob=view(0.3)) + "\n"
    second = summary_line(0, 2, 0, loss=4.25, glob=view(0.22, 0.18))
    path.write_text(first + second[:17])  # a collector is half-way through its write
    assert tail.poll() is True
    assert (tail.step, tail.loss, tail.bubble) == (1, 4.5, {0: 0.3})
    assert tail.poll() is False  # the torn line is not consumed
    with open(path, "a") as f:
        f.write(second[17:] + "\n" + summary_line(2, 2, 1, bubble=0.9) + "\n")
    assert tail.poll() is True
    assert (tail.step, tail.loss) == (2, 4.25)
    # The stage bubble is rank 0's view of the stage (the guardrail's), never one rank's own ratio.
    assert tail.bubble == {0: 0.22, 1: 0.18} and tail.theory == {0: 0.2, 1: 0.2}


def test_tail_skips_garbage_and_falls_back_to_the_fast_path_loss(tmp_path):
    path = tmp_path / "summaries.jsonl"
    path.write_text(
        "not json\n"
        + summary_line(1, 3, 0)
        + "\n"
        + summary_line(0, 3, 0, loss=None, glob={"step": 2, "loss": "nan"})
        + "\n"
    )
    tail = SummaryTail(path)
    assert tail.poll() is True
    assert (tail.step, tail.loss) == (3, "nan")  # only rank 0 moves the step


def test_tail_follows_a_rollback_back_to_an_earlier_step(tmp_path):
    path = tmp_path / "summaries.jsonl"
    path.write_text(summary_line(0, 9, 0, loss=3.0) + "\n")
    tail = SummaryTail(path)
    tail.poll()
    with open(path, "a") as f:
        f.write(summary_line(0, 6, 0, loss=3.2) + "\n")
    assert tail.poll() is True and tail.step == 6


def test_status_line_without_a_sidecar_answer(tmp_path):
    tail = SummaryTail(tmp_path / "none.jsonl")
    tail.step, tail.loss = 7, 3.14159
    tail.bubble, tail.theory = {1: 0.31, 0: 0.2534}, {0: 0.2, 1: 0.2}
    assert status_line(tail, None) == (
        "step    7  loss   3.1416  bubble measured/theory s0=0.253/0.200 s1=0.310/0.200  guardrails all ok"
    )


def test_status_line_names_rules_not_ok_and_a_pause(tmp_path):
    tail = SummaryTail(tmp_path / "none.jsonl")
    tail.step, tail.loss = 12, "nan"
    status = {
        "paused": True,
        "rules": {
            "stage-skew": {"state": "firing"},
            "loss-spike": {"state": "ok"},
            "bubble-excess": {"state": "pending"},
        },
    }
    line = status_line(tail, status)
    assert "loss      nan" in line
    assert line.endswith("guardrails bubble-excess:pending stage-skew:firing PAUSED")
    assert "loss-spike" not in line


def test_status_line_before_the_first_loss(tmp_path):
    assert "loss        -" in status_line(SummaryTail(tmp_path / "x"), {"rules": {}})


def test_pause_hint_names_the_reason_and_the_resume_command():
    status = {
        "paused": True,
        "last_decisions": [
            {"action": "alert", "reason": "skew"},
            {"action": "pause", "reason": "nonfinite-loss: no checkpoint before step 5"},
        ],
    }
    hint = pause_hint(status, "http://127.0.0.1:9999")
    assert "(nonfinite-loss: no checkpoint before step 5)" in hint
    assert "parwatch resume --endpoint http://127.0.0.1:9999" in hint
    assert "Ctrl-C" in pause_hint({"paused": True}, "http://x")


def test_build_summary_on_a_synthetic_run(tmp_path):
    info = make_run_dir(tmp_path / "run", pp=4, microbatches=8, tp=2, steps=10, nan_loss_step=6)
    (info.path / "summary.json").write_text(json.dumps({"steps_completed": 10, "losses": [4.0, 3.9]}))
    summary = build_summary(info.path, pp=4, microbatches=8, chunks=1, price=3.0)

    theory = closed_form(4, 8)
    assert [s["stage"] for s in summary["stages"]] == [0, 1, 2, 3]
    for s in summary["stages"]:
        assert s["bubble_theoretical_ratio"] == pytest.approx(3 / 11) == theory
        # Uniform simulated stages: the measured bubble is the formula plus p2p latency.
        assert theory - 0.02 < s["bubble_ratio"] < theory + 0.1
        assert s["steps"] > 0

    by_key = {(c["op"], c["group"]): c for c in summary["collectives"]}
    assert {("all_reduce", "tp"), ("send", "pp"), ("recv", "pp")} <= set(by_key)
    lines = [json.loads(x) for x in (info.path / "summaries.jsonl").read_text().splitlines()]
    tp_count = sum(c["count"] for x in lines for c in x["collectives"] if (c["op"], c["group"]) == ("all_reduce", "tp"))
    ar = by_key[("all_reduce", "tp")]
    assert ar["count"] == tp_count
    assert 0 < ar["p50_seconds"] <= ar["p99_seconds"]
    assert ar["busbw_bytes_per_second"] > 0

    assert [d["rule"] for d in summary["decisions"] if d["type"] == "decision"] == ["stage-skew", "nonfinite-loss"]
    assert summary["steps_completed"] == 10 and summary["losses"] == [4.0, 3.9]
    assert summary["cost"]["price_per_gpu_hour"] == 3.0
    assert summary["cost"]["idle_cost"] == pytest.approx(summary["cost"]["idle_gpu_hours"] * 3.0)


def test_build_summary_without_the_trainers_summary(tmp_path):
    info = make_run_dir(tmp_path / "run", pp=2, microbatches=4, steps=4, decision=False)
    summary = build_summary(info.path, pp=2, microbatches=4, chunks=1, price=2.0)
    assert summary["steps_completed"] is None and summary["losses"] == [] and summary["decisions"] == []
    assert [s["bubble_theoretical_ratio"] for s in summary["stages"]] == [pytest.approx(0.2)] * 2


def test_print_summary_shows_every_table(tmp_path):
    info = make_run_dir(tmp_path / "run", pp=2, microbatches=4, tp=2, steps=6, nan_loss_step=4)
    console = Console(record=True, width=200)
    print_summary(console, build_summary(info.path, pp=2, microbatches=4, chunks=1, price=2.0))
    text = console.export_text()
    for title in ("Pipeline bubble per stage", "Collectives", "Guardrail decisions", "Idle accelerator time"):
        assert title in text
    assert "nonfinite-loss" in text and "rollback" in text and "all_reduce" in text


def test_print_summary_says_when_no_rule_acted(tmp_path):
    info = make_run_dir(tmp_path / "run", pp=2, microbatches=4, steps=4, decision=False)
    console = Console(record=True, width=200)
    print_summary(console, build_summary(info.path, pp=2, microbatches=4, chunks=1, price=2.0))
    assert "Guardrail decisions: none" in console.export_text()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_live_group_members_finds_this_process_and_nothing_for_an_unused_group():
    assert os.getpid() in live_group_members(os.getpgrp())
    unused = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 100_000
    assert live_group_members(unused) == []


def test_free_ports_lie_below_the_range_outgoing_connections_draw_from():
    import socket

    from parwatch.ports import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < ephemeral for p in ports), ports
    with socket.socket() as s:  # and free
        s.bind(("127.0.0.1", ports.pop()))
