"""Deferred engine writes (the sidecar's mode): nothing touches the disk on the event loop, and
everything a request decided is on disk before its answer (so before any directive goes out)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3

from parwatch.guardrails.engine import GuardrailEngine, Observation
from parwatch.guardrails.rules import Rule, RuleSet
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar
from parwatch.wire.codec import parse
from parwatch.wire.steps import IngestBody
from tests.fixtures import synthetic as syn


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_decisions_reach_the_disk_before_the_answer(tmp_path):
    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path))
    sidecar.defer_writes()
    stages = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.38)]
    body = parse(
        {
            "version": 1,
            "summaries": [
                syn.summary(
                    0, step, global_stages=stages, checkpoints=[1], global_loss=float("nan") if step == 3 else 2.0
                )
                for step in range(1, 5)
            ],
        },
        IngestBody,
    )
    sidecar._admit(body)
    for s in body.summaries:  # the work of ingest_async, without its persist
        sidecar._ingest_one(s)
    assert not any(r.get("type") == "decision" for r in lines(tmp_path / "decisions.jsonl"))  # only queued
    reply = asyncio.run(_persist_then_reply(sidecar, body))
    decisions = [r for r in lines(tmp_path / "decisions.jsonl") if r.get("type") == "decision"]
    assert decisions and decisions[-1]["rule"] == "nonfinite-loss"
    assert reply["directive"]["id"] == decisions[-1]["directive_id"]
    with contextlib.closing(sqlite3.connect(tmp_path / "parwatch.db")) as db:
        assert db.execute("SELECT id FROM directives").fetchall() == [(reply["directive"]["id"],)]
        assert db.execute("SELECT delivered_at IS NOT NULL FROM directives").fetchone() == (1,)  # delivered: saved
    sidecar.close()


async def _persist_then_reply(sidecar, body):
    await sidecar.persist()
    reply = sidecar.ingest_reply(body)
    await sidecar.persist()  # as ingest_async does: the delivery is saved before the answer
    return reply


def test_a_new_run_archives_the_old_run_in_order(tmp_path):
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
    with contextlib.closing(sqlite3.connect(tmp_path / "parwatch.db")) as db:
        runs = db.execute("SELECT run_id, archived_at IS NOT NULL FROM runs ORDER BY run_id").fetchall()
        assert runs == [("a", 1), ("b", 0)]
        assert [json.loads(line)["run_id"] for (line,) in db.execute("SELECT line FROM records")] == ["a"]
