"""The hang line of `parwatch status` (parwatch.cli.control), from GET /v1/hang's answer."""

from parwatch.cli.control import _hang_line, _status_text


def test_hang_line_names_the_culprit():
    hang = {
        "leader": True,
        "rank_states": {"running": 3, "hung": 1},
        "bound_seconds": 10.0,
        "hang": {
            "evidence": {
                "culprit": {"rank": 3, "stage": 1, "host": "node-b", "kind": "send", "op": "send"},
                "waiting_count": 3,
            }
        },
    }
    line = _hang_line(hang)
    assert line == "HANG: rank 3 (stage 1, host node-b) in send; 3 ranks wait for it (ranks: 1 hung, 3 running)"
    assert line in _status_text({"ranks": {}, "hang": hang})


def test_hang_line_when_healthy_not_leader_or_old_sidecar():
    assert (
        _hang_line({"leader": True, "rank_states": {"running": 2}, "bound_seconds": 10.0, "hang": None})
        == "hang: none (ranks: 2 running; bound 10 s)"
    )
    assert "--leader-url" in _hang_line({"leader": False, "leader_url": None})
    assert _hang_line(None).startswith("hang: no activity data")
