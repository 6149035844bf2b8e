"""Issue 25, item 6, against a real `parwatch sidecar`: re-arming a rule cannot be suppressed.

On 40e8301, after an operator resume on NaN weights the re-armed rule fired before the resume was
applied, its pause was suppressed as "already paused", and nothing re-armed it again: 396 of 400
steps NaN, the run ended normally. (Cancelling a rule's directive, which left the same hole, is
tested on the engine: tests/unit/test_engine_directives.py. A rule's directive is delivered in the
reply to the very post that made it, so over HTTP it can no longer be cancelled.)
"""

from __future__ import annotations

import json

import pytest

from tests import one_client
from tests.fixtures import synthetic as syn
from tests.sidecar_process import running_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
STAGES = [syn.stage_view(0, 0.5, 0.38), syn.stage_view(1, 0.5, 0.38)]
NAN = {"global_loss": float("nan")}


def _post(sp, steps, outcomes=(), **kw) -> dict:
    summaries = [
        syn.summary(r, step, global_stages=STAGES if r == 0 else None, checkpoints=[1], **kw)
        for step in steps
        for r in (0, 1)
    ]
    r = one_client.post(
        f"{sp.control_url}/v1/ingest",
        headers=sp.headers,
        timeout=30,
        json={"version": 1, "summaries": summaries, "outcomes": list(outcomes)},
    )
    assert r.status_code == 200, r.text
    return r.json()


def _rule_decisions(sp, rule="nonfinite-loss") -> list[dict]:
    return [
        d
        for d in one_client.get(f"{sp.control_url}/v1/decisions", headers=sp.headers, timeout=10).json()
        if d.get("rule") == rule
    ]


def _rules(tmp_path, action: str):
    path = tmp_path / "rules.yaml"
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "rules": [
                    {
                        "name": "nonfinite-loss",
                        "metric": "loss",
                        "check": "finite",
                        "action": action,
                        "cooldown_steps": 2,
                    }
                ],
            }
        )
    )
    return str(path)


def test_a_rule_failing_while_a_resume_is_on_its_way_pauses_the_run_again(tmp_path):
    with running_sidecar(tmp_path / "state", "--rules", _rules(tmp_path, "pause")) as sp:
        pause = _post(sp, [1, 2, 3], **NAN)["directive"]
        assert pause["action"] == "pause"
        _post(sp, [], outcomes=[syn.outcome(pause["id"], step=3)])  # every rank paused
        resume = one_client.post(
            f"{sp.control_url}/v1/control",
            headers=sp.headers,
            timeout=10,
            json={"action": "resume", "reason": "weights look fine"},
        ).json()
        assert resume["rearmed_rules"] == ["nonfinite-loss"]
        # The ranks resumed and train on NaN weights before rank 0's outcome of the resume arrives.
        reply = _post(sp, [4, 5, 6], **NAN)
        assert reply["directive"]["id"] == resume["directive_id"]  # the resume first ...
        _post(sp, [], outcomes=[syn.outcome(resume["directive_id"], step=6)])
        again = _post(sp, [7], **NAN)["directive"]
        decisions = _rule_decisions(sp)
    assert len(decisions) == 2 and decisions[1]["enforced"] is True, decisions
    assert again is not None and again["action"] == "pause" and again["id"] == decisions[1]["directive_id"]
