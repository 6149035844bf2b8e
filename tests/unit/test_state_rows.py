"""Issue 43, finding 8 (the state's own faults): a row that does not hold what its column should, a database of
another schema, and a state recovered from decisions.jsonl alone. On d484f20 `paused = 'no'` read as paused, a
bad row or another schema stopped the start with a traceback, and recovery from the log forgot that a directive
was delivered (a later cancel answered 200 for a directive every rank had)."""

from __future__ import annotations

import contextlib
import logging
import sqlite3

import pytest
from fastapi.testclient import TestClient

from parwatch.guardrails.engine import GuardrailEngine
from parwatch.guardrails.rules import default_rules
from parwatch.sidecar.app import create_control_app
from parwatch.sidecar.config import SidecarConfig
from parwatch.sidecar.service import build_sidecar
from tests.fixtures import synthetic as syn


def _engine(state) -> GuardrailEngine:
    engine = GuardrailEngine(default_rules(), state)
    engine.begin_run("r1")
    return engine


def _sql(state, *statements) -> None:
    with contextlib.closing(sqlite3.connect(state / "parwatch.db")) as db:
        for statement in statements:
            db.execute(statement)
        db.commit()


def _aside(state) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(state / "parwatch.db")) as db:
        return db.execute("SELECT tbl, reason FROM rows_aside").fetchall()


@pytest.mark.parametrize(
    "column, value",
    [("paused", "'no'"), ("paused", "2"), ("checkpoints", "'x'"), ("rearmed", "'[1]'"), ("tick", "'many'")],
)
def test_a_row_whose_column_holds_the_wrong_type_is_moved_aside_with_an_error(tmp_path, caplog, column, value):
    _engine(tmp_path).close()
    _sql(tmp_path, f"UPDATE runs SET {column} = {value}")
    with caplog.at_level(logging.ERROR):
        again = GuardrailEngine(default_rules(), tmp_path)  # no traceback: the start goes on
    assert not again.paused  # 'no' never reads as paused: the run's row is set aside, no current run
    assert again.run_id is None
    assert "a row of table runs is unreadable" in caplog.text and column in caplog.text
    assert [t for t, _ in _aside(tmp_path)] == ["runs"]


def test_a_database_of_another_schema_is_moved_aside_and_the_log_recovers_the_run(tmp_path, caplog):
    engine = _engine(tmp_path)
    engine.request("pause", source="operator", reason="before")
    engine.close()
    _sql(tmp_path, "DROP TABLE runs", "CREATE TABLE runs (run_id TEXT PRIMARY KEY, paused TEXT)")
    with caplog.at_level(logging.ERROR):
        again = GuardrailEngine(default_rules(), tmp_path)
    assert "not a usable database" in caplog.text and "another schema" in caplog.text
    assert again.run_id == "r1" and [d["action"] for d in again.directive_states()] == ["pause"]
    assert list(tmp_path.glob("parwatch.db.invalid-*"))


def test_a_state_recovered_from_the_log_keeps_what_was_delivered(tmp_path):
    sidecar = build_sidecar(SidecarConfig(state_dir=tmp_path, token="t"))
    client = TestClient(create_control_app(sidecar), headers={"Authorization": "Bearer t"})
    stages = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.38)]
    client.post("/v1/ingest", json={"version": 1, "summaries": [syn.summary(0, 1, global_stages=stages)]})
    made = client.post("/v1/control", json={"action": "pause"}).json()
    answer = client.post("/v1/ingest", json={"version": 1, "summaries": []}).json()
    assert answer["directive"]["id"] == made["directive_id"]  # delivered to rank 0
    sidecar.close()
    for suffix in ("", "-wal", "-shm"):  # the database is lost; decisions.jsonl is what is left
        (tmp_path / f"parwatch.db{suffix}").unlink(missing_ok=True)
    again = build_sidecar(SidecarConfig(state_dir=tmp_path, token="t"))
    client = TestClient(create_control_app(again), headers={"Authorization": "Bearer t"})
    r = client.post(f"/v1/directives/{made['directive_id']}/cancel", json={})
    assert r.status_code == 409 and r.json()["directive"]["state"] == "delivered", r.text
    assert [d["state"] for d in client.get("/v1/status").json()["directives"]] == ["delivered"]
