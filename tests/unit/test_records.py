"""parwatch.wire.activity: the hot posts' typed records refuse what breaks a bound with the field named as the
sidecar's 422 says it, and the OpenAPI schemas generated from them say the same bounds."""

from __future__ import annotations

import json

import pytest
from msgspec.structs import astuple, replace

from parwatch.wire import openapi_components
from parwatch.wire.activity import ROW_FIELDS, Activity, ActivityPost, ActivityReport, NodeDigest
from parwatch.wire.bounds import MAX_PID
from parwatch.wire.codec import BadRecord, decode, encode


def _row(**change) -> list:
    a = Activity(1, "running", "forward", None, None, None, None, 9.0, 3, 0.1, 20_001, "node-b", 1, 0, 0, 10.0, 8.0)
    return list(astuple(replace(a, **change)))


def _digest(rows) -> bytes:
    return json.dumps(
        {"version": 1, "node": "n:9401", "run_id": "r", "time": 10.0, "layout": [1, 2, 1], "rows": rows}
    ).encode()


@pytest.mark.parametrize(
    "row, detail",
    [
        (_row(pid=-5), "digest.rows[0].pid: Expected `int` >= 0"),
        (_row(pid=MAX_PID + 1), f"digest.rows[0].pid: Expected `int` <= {MAX_PID}"),
        (_row(time="soon"), "digest.rows[0].time: Expected `float`, got `str`"),
        (
            _row(state="exploded"),
            "digest.rows[0].state: Invalid enum value 'exploded' (one of running, done, crashed, gone, silent)",
        ),
        (_row(host="node-b\n"), "digest.rows[0].host: Expected `str` without control characters"),
        (_row(kind="k" * 65), "digest.rows[0].kind: Expected `str` of length <= 64"),
        (_row(ended=-1.0), "digest.rows[0].ended: Expected `float` >= 0.0"),
        (_row()[:15], "digest.rows[0]: Expected `array` of at least length 17, got 15 (a row is [rank, state,"),
    ],
)
def test_a_digest_row_out_of_bounds_names_its_field_and_bound(row, detail):
    with pytest.raises(BadRecord) as err:
        decode(_digest([row]), NodeDigest, "digest")
    assert str(err.value).startswith(detail), str(err.value)


def test_an_activity_report_names_its_field_and_its_states():
    post = {"version": 1, "activity": {"rank": 0, "pid": 1, "stage": 0, "tp_rank": 0, "dp_rank": 0, "tp": 1}}
    post["activity"].update(pp=1, dp=1, step=1, time=1.0, state="gone")
    with pytest.raises(
        BadRecord, match=r"^activity.state: Invalid enum value 'gone' \(one of running, done, crashed\)"
    ):
        decode(json.dumps(post).encode(), ActivityPost, "")
    with pytest.raises(BadRecord, match="^body is not valid JSON"):
        decode(b"{nope", ActivityPost, "")
    post["activity"].update(state="done", host=None)
    report = decode(json.dumps(post).encode(), ActivityPost, "").activity
    assert report.row().host == "" and report.row().step_end is None


def test_what_is_encoded_decodes_and_a_row_without_its_error_reads_it_as_null():
    report = ActivityReport(rank=0, pid=1, stage=0, tp_rank=0, dp_rank=0, tp=1, pp=2, dp=1, step=-1, time=5.0)
    assert decode(encode(ActivityPost(1, report)), ActivityPost, "").activity == report
    digest = NodeDigest(1, "n", "r", 10.0, (1, 2, 1), [Activity(*_row(step_end=None)[:17])])
    assert decode(encode(digest), NodeDigest, "digest") == digest
    assert digest.rows[0].step_end is None and digest.rows[0].error is None
    newer = [*_row(), "a field of a newer node"]  # ignored: a newer node still reaches this leader
    assert decode(_digest([newer]), NodeDigest, "digest").rows[0] == Activity(*_row())


def test_the_openapi_schemas_hold_the_same_bounds_in_ecma_regex():
    schemas = openapi_components()
    assert {"ActivityPost", "ActivityReport", "NodeDigest", "Activity"} <= set(schemas)
    row = schemas["Activity"]
    assert row["minItems"] == 17 and "maxItems" not in row  # a newer node's extra fields are ignored
    pid = row["prefixItems"][ROW_FIELDS.index("pid")]
    assert (pid["minimum"], pid["maximum"]) == (0, MAX_PID)
    host = row["prefixItems"][ROW_FIELDS.index("host")]
    assert host["pattern"].endswith("]*$") and "\\Z" not in json.dumps(schemas)  # \Z is not ECMA regex
