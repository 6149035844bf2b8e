"""State that fails validation, against a real sidecar process (issue 25, item 10; issue 22, item 4). An
unreadable parwatch.db is moved aside with an error naming it, and the run and its outstanding directives
are recovered from decisions.jsonl, as when there is no database (a first start on an older state dir); a
log line that is not a record is skipped with a warning."""

from __future__ import annotations

import json

import pytest

from tests import one_client
from tests.fixtures import synthetic as syn
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
RUN = "run-kept"


def _decision(did: int, directive_id: int | None, action: str = "pause", run_id: str = RUN) -> dict:
    return {
        "type": "decision",
        "id": did,
        "run_id": run_id,
        "time": 1.0,
        "step": 3,
        "rule": None,
        "action": action,
        "source": "operator",
        "requested_by": "test",
        "enforced": True,
        "reason": "kept",
        "evidence": {},
        "checkpoint": None,
        "skip_batches": 0,
        "directive_id": directive_id,
    }


def _poll(sp) -> dict:
    """Rank 0's ingest of its run: the reply carries the directive outstanding for it."""
    body = {"version": 1, "summaries": [syn.summary(r, 4, run_id=RUN) for r in (0, 1)]}
    r = one_client.post(f"{sp.control_url}/v1/ingest", json=body, headers=sp.headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_line_that_is_not_a_record_is_skipped(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "decisions.jsonl").write_text("[1, 2]\n" + json.dumps(_decision(1, None, "alert")) + '\n"text"\n')
    with running_sidecar(state) as sp:
        decisions = one_client.get(f"{sp.control_url}/v1/decisions", headers=sp.headers, timeout=5).json()
        log = sp.log()
    assert [d["id"] for d in decisions] == [1]
    assert log.count("that is not a record") == 2


def test_an_unreadable_database_is_moved_aside_and_the_log_keeps_the_directive(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    log_lines = [
        _decision(1, 7, "pause"),
        _decision(2, 8, "rollback"),
        {"type": "applied", "directive_id": 8, "action": "rollback", "time": 2.0},
    ]
    (state / "decisions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log_lines))
    (state / "parwatch.db").write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)  # a damaged header
    with running_sidecar(state) as sp:
        reply = _poll(sp)
        log = sp.log()
    assert [p.name.split(".invalid-")[0] for p in state.glob("*.invalid-*")] == ["parwatch.db"]
    assert "parwatch.db is not a usable database" in log and "moved aside" in log
    assert "recovered from decisions.jsonl: run run-kept, outstanding directives [7]" in log
    directive = reply["directive"]
    assert (directive["id"], directive["action"], directive["run_id"]) == (7, "pause", RUN)
    with running_sidecar(state) as sp:  # the new database holds what was recovered
        assert _poll(sp)["directive"]["id"] == 7
        assert "recovered" not in sp.log()
