"""Deferred engine writes (the sidecar's mode): nothing touches the disk on the event loop, and
everything a request decided is on disk before its answer (so before any directive goes out)."""

from __future__ import annotations

import asyncio
import json

from parwatch.guardrails.engine import GuardrailEngine, Observation
from parwatch.guardrails.rules import Rule, RuleSet
from parwatch.sidecar import synthetic as syn
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.models import IngestBody
from parwatch.sidecar.service import build_sidecar


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_decisions_reach_the_disk_before_the_answer(tmp_path):
    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path))
    sidecar.defer_writes()
    stages = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.38)]
    body = IngestBody.model_validate(
        {
            "version": 1,
            "summaries": [
                syn.summary(
                    0, step, global_stages=stages, checkpoints=[1], global_loss=float("nan") if step == 3 else 2.0
                )
                for step in range(1, 5)
            ],
        }
    )
    sidecar._admit(body)
    for s in body.summaries:  # the work of ingest_async, without its persist
        sidecar._ingest_one(s)
    assert not any(r.get("type") == "decision" for r in lines(tmp_path / "decisions.jsonl"))  # only queued
    reply = asyncio.run(_persist_then_reply(sidecar, body))
    decisions = [r for r in lines(tmp_path / "decisions.jsonl") if r.get("type") == "decision"]
    assert decisions and decisions[-1]["rule"] == "nonfinite-loss"
    assert reply["directive"]["id"] == decisions[-1]["directive_id"]
    assert json.loads((tmp_path / "state.json").read_text())["directives"]["outstanding"]
    sidecar.close()


async def _persist_then_reply(sidecar, body):
    await sidecar.persist()
    return sidecar.ingest_reply(body)


def test_a_new_run_archives_the_old_runs_files_in_order(tmp_path):
    rules = RuleSet(rules=(Rule(name="nan", metric="loss", check="finite", action="alert"),))
    engine = GuardrailEngine(rules, tmp_path)
    engine.defer_writes()
    engine.begin_run("a")
    engine.evaluate(Observation(step=1, time=1.0, series={"loss": {"": float("nan")}}))
    engine.begin_run("b")  # before the writer ran: run a's decision must still land in run a's files
    engine.evaluate(Observation(step=1, time=2.0, series={"loss": {"": 1.0}}))
    engine.take_writes().write()
    old = [r for r in lines(tmp_path / "runs" / "a" / "decisions.jsonl") if r.get("type") == "decision"]
    assert [r["rule"] for r in old] == ["nan"]
    assert not [r for r in lines(tmp_path / "decisions.jsonl") if r.get("type") == "decision"]
    assert json.loads((tmp_path / "state.json").read_text())["run_id"] == "b"
