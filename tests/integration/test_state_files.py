"""State files that fail validation, against a real sidecar process (issue 25, item 10). On 8fae0f2 a
wrong-typed state.json, a non-object line in decisions.jsonl or an object in alerts_acted.json stopped the
sidecar from starting (a traceback); a garbled state.json dropped an outstanding directive that
decisions.jsonl still recorded; a JSON-list state.json started clean without a word. Now a file that cannot
be used is moved aside with a warning naming it and what was kept; one bad field costs only that field."""

from __future__ import annotations

import json

import httpx
import pytest

from parwatch.sidecar import synthetic as syn
from parwatch.sidecar.process import running_sidecar

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


def _seed(state, **files) -> None:
    state.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (state / name.replace("_json", ".json").replace("_jsonl", ".jsonl")).write_text(text)


def _aside(state, name: str) -> list[str]:
    return sorted(p.name for p in state.glob(f"{name}.invalid-*"))


def _poll(sp) -> dict:
    """Rank 0's ingest of its run: the reply carries the directive outstanding for it."""
    body = {"version": 1, "summaries": [syn.summary(r, 4, run_id=RUN) for r in (0, 1)]}
    r = httpx.post(f"{sp.control_url}/v1/ingest", json=body, headers=sp.headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_json_list_state_is_moved_aside_with_a_warning(tmp_path):
    state = tmp_path / "state"
    _seed(state, state_json="[]")
    with running_sidecar(state) as sp:
        assert httpx.get(f"{sp.control_url}/healthz", timeout=5).status_code == 200
        log = sp.log()
    [aside] = _aside(state, "state.json")
    assert "state.json is not usable (a JSON list, not an object)" in log and aside in log


def test_wrong_typed_fields_cost_only_themselves(tmp_path):
    state = tmp_path / "state"
    kept = {"id": 3, "action": "pause", "run_id": RUN, "to_step": None, "skip_batches": 0, "reason": "kept"}
    _seed(
        state,
        state_json=json.dumps(
            {
                "run_id": RUN,
                "directives": {"outstanding": [kept], "next_id": 4},
                "paused": "yes",
                "tick": "x",
                "rules": [],
                "rearmed": 5,
                "checkpoints": {"a": 1},
            }
        ),
    )
    with running_sidecar(state) as sp:
        status = httpx.get(f"{sp.control_url}/v1/status", headers=sp.headers, timeout=5).json()
        reply = _poll(sp)
        log = sp.log()
    assert status["paused"] is False and reply["directive"]["id"] == 3  # the usable fields were kept
    for field in ("paused", "tick", "rules", "rearmed", "checkpoints"):
        assert f"{field}=" in log, field
    assert log.count("is not usable") == 5 and not _aside(state, "state.json")


def test_a_line_that_is_not_a_record_is_skipped(tmp_path):
    state = tmp_path / "state"
    _seed(state, decisions_jsonl="[1, 2]\n" + json.dumps(_decision(1, None, "alert")) + '\n"text"\n')
    with running_sidecar(state) as sp:
        decisions = httpx.get(f"{sp.control_url}/v1/decisions", headers=sp.headers, timeout=5).json()
        log = sp.log()
    assert [d["id"] for d in decisions] == [1]
    assert log.count("that is not a record") == 2


def test_an_object_in_alerts_acted_is_moved_aside(tmp_path):
    state = tmp_path / "state"
    _seed(state, alerts_acted_json='{"fingerprint": 1}')
    with running_sidecar(state) as sp:
        assert httpx.get(f"{sp.control_url}/healthz", timeout=5).status_code == 200
        log = sp.log()
    assert _aside(state, "alerts_acted.json") and "alerts may act once more" in log


def test_a_garbled_state_keeps_the_directive_the_log_records(tmp_path):
    state = tmp_path / "state"
    log_lines = [
        _decision(1, 7, "pause"),
        _decision(2, 8, "rollback"),
        {"type": "applied", "directive_id": 8, "action": "rollback", "time": 2.0},
    ]
    _seed(
        state,
        state_json='{"run_id": "run-kept", "directives": {"outs',
        decisions_jsonl="".join(json.dumps(r) + "\n" for r in log_lines),
    )
    with running_sidecar(state) as sp:
        reply = _poll(sp)
        log = sp.log()
    assert _aside(state, "state.json")
    assert "recovered from decisions.jsonl: run run-kept, outstanding directives [7]" in log
    directive = reply["directive"]
    assert (directive["id"], directive["action"], directive["run_id"]) == (7, "pause", RUN)
