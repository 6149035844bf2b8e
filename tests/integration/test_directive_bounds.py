"""Issue 25, item 5, against a real `parwatch sidecar`: a directive the sidecar hands out is always
one the trainer can parse (one parser, parwatch.contract.parse_directive, judges both sides).

On 40e8301 `skip_batches = 2**53` passed the sidecar's bound (<=) and failed the trainer's (<): the
directive was repeated forever and every later one (NaN rollbacks) was never delivered. A
decisions.jsonl id of 2**60 did the same to every later directive, silently.
"""

from __future__ import annotations

import json

import httpx
import pytest

from parwatch.contract.directives import MAX_STEP, parse_directive
from tests.fixtures import synthetic as syn
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _ingest(sp, step: int) -> dict:
    stages = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.38)]
    summaries = [syn.summary(r, step, global_stages=stages if r == 0 else None, checkpoints=[1]) for r in (0, 1)]
    r = httpx.post(
        f"{sp.control_url}/v1/ingest", json={"version": 1, "summaries": summaries}, headers=sp.headers, timeout=30
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_a_skip_count_the_trainer_would_refuse_is_a_422(tmp_path):
    with running_sidecar(tmp_path / "state") as sp:
        _ingest(sp, 1)
        for field, value in (("skip_batches", MAX_STEP), ("to_step", MAX_STEP), ("skip_batches", 2**60)):
            r = httpx.post(
                f"{sp.control_url}/v1/control",
                headers=sp.headers,
                json={"action": "rollback", field: value, "reason": "test"},
            )
            assert r.status_code == 422 and field in r.text, r.text
        r = httpx.post(
            f"{sp.control_url}/v1/control",
            headers=sp.headers,
            json={"action": "rollback", "skip_batches": MAX_STEP - 1, "reason": "the largest"},
        )
        assert r.status_code == 200, r.text
        directive = _ingest(sp, 2)["directive"]
        assert parse_directive(directive).skip_batches == MAX_STEP - 1


def test_a_directive_id_past_2_53_in_the_log_does_not_block_later_directives(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    forged = {
        "type": "decision",
        "id": 2**60,
        "time": 1.0,
        "step": 1,
        "rule": "operator",
        "action": "pause",
        "source": "operator",
        "reason": "forged",
        "directive_id": 2**60,
    }
    (state / "decisions.jsonl").write_text(json.dumps(forged) + "\n")
    with running_sidecar(state) as sp:
        _ingest(sp, 1)
        r = httpx.post(f"{sp.control_url}/v1/control", headers=sp.headers, json={"action": "pause", "reason": "t"})
        assert r.status_code == 200, r.text
        directive = _ingest(sp, 2)["directive"]
        assert directive is not None and parse_directive(directive).id < MAX_STEP
        assert "not usable" in sp.log()
