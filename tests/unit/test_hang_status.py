"""The hang line of `parwatch status` (parwatch.cli.control), from GET /v1/hang's answer."""

import json

import msgspec

from parwatch.cli.control import _hang_line, _status_text
from parwatch.vocabulary import BuiltinRule, RankState
from parwatch.wire.findings import Culprit, HangEvidence


def test_hang_line_names_the_culprit():
    culprit = Culprit(
        rank=3, state=RankState.RUNNING, stage=1, tp_rank=0, dp_rank=1, host="node-b", pid=7, kind="send", op="send",
        group="pp", peer=0, seq=None, since=100.0, step=4, ended=None,
    )  # fmt: skip
    evidence = HangEvidence(
        culprit=culprit, points_at=None, kind=None, kind_waits_on=[], waiting=[0, 1, 2], waiting_count=3,
        waits_on={0: [3]}, missing=None, method="dependency", stalled_seconds=10.0, since_boundary_seconds=10.0,
        busy=None, stalled_since=990.0, bound_seconds=10.0, median_step_seconds=1.0, last_step=4, stale_ranks=0,
        coverage=None,
    )  # fmt: skip
    record = {"rule": BuiltinRule.HANG, "reason": "hang (host blocked): rank 3 ...", "evidence": evidence}
    hang = {
        "leader": True,
        "rank_states": {"running": 3, "hung": 1},
        "bound_seconds": 10.0,
        "hang": json.loads(msgspec.json.encode(record)),  # as GET /v1/hang answers it
    }
    line = _hang_line(hang)
    assert line == "HANG: rank 3 (stage 1, host node-b) in send; 3 ranks wait for it (ranks: 1 hung, 3 running)"
    assert line in _status_text({"ranks": {}, "hang": hang})
    # An older sidecar's evidence of another shape: its reason says it.
    hang["hang"] = {**record, "evidence": {"culprit": {"rank": 3}}}
    assert _hang_line(hang) == "HANG: hang (host blocked): rank 3 ... (ranks: 1 hung, 3 running)"


def test_hang_line_when_healthy_not_leader_or_old_sidecar():
    assert (
        _hang_line({"leader": True, "rank_states": {"running": 2}, "bound_seconds": 10.0, "hang": None})
        == "hang: none (ranks: 2 running; bound 10 s)"
    )
    assert "--leader-url" in _hang_line({"leader": False, "leader_url": None})
    assert _hang_line(None).startswith("hang: no activity data")
