"""The collector sends its step summary as its record, StepSummary (collector/wire.py: encode_summary):
every figure it built arrives, and one that does not fit the record is still sent, as built."""

from __future__ import annotations

import json
import logging

from test_collector_sim import pipeline, run_steps

from parwatch.collector.wire import encode_summary
from parwatch.vocabulary import jsonable
from parwatch.wire.codec import decode
from parwatch.wire.steps import StepSummary


def _built(summary: dict) -> dict:
    """The summary as the collector built it, as JSON (what it sent before it had a record)."""
    return json.loads(json.dumps(jsonable(summary)))


def _assert_kept(built, sent, where="summary"):
    """Every key and value built is in what is sent; what is sent beyond it is a record's default (null)."""
    if isinstance(built, dict):
        assert isinstance(sent, dict), where
        assert built.keys() <= sent.keys(), f"{where}: {sorted(built.keys() - sent.keys())} not sent"
        for key, value in sent.items():
            if key in built:
                _assert_kept(built[key], value, f"{where}.{key}")
            else:
                assert value is None, f"{where}.{key}: {value!r} sent, never built"
    elif isinstance(built, list):
        assert isinstance(sent, list) and len(sent) == len(built), where
        for i, (b, s) in enumerate(zip(built, sent)):
            _assert_kept(b, s, f"{where}[{i}]")
    else:
        assert sent == built, f"{where}: built {built!r}, sent {sent!r}"


def _summaries(steps=4, **step_kw):
    """Every summary of a 2-stage run, as the shipper's thread has them (its bubble causes added)."""
    run = pipeline(p=2, m=4)
    taken: list[list[dict]] = [[] for _ in run.ranks]
    for r, rank in enumerate(run.ranks):
        rank.collector.shipper.put_summary = lambda s, delivery=None, r=r: taken[r].append(s)
    losses = {3: float("nan")}
    run_steps(run, steps, 0.1, loss=lambda step: losses.get(step, 2.5), **step_kw)
    for rank, summaries in zip(run.ranks, taken):
        for summary in summaries:
            rank.collector._prepare(summary)
    return [s for summaries in taken for s in summaries]


def test_every_figure_the_collector_builds_is_sent_in_its_record():
    summaries = _summaries(dp_sync=0.004, tp_allreduce=0.001)
    assert len(summaries) >= 4 and any(s["global"] for s in summaries)  # rank 0's global view is there
    assert any(s["collectives"] for s in summaries)
    for summary in summaries:
        sent = encode_summary(summary)
        _assert_kept(_built(summary), json.loads(sent))
        record = decode(sent.encode(), StepSummary)  # as the sidecar reads it
        assert (record.rank, record.step) == (summary["rank"], summary["step"])
    nan_step = [s for s in summaries if s["step"] == 3]
    assert nan_step and all(json.loads(encode_summary(s))["loss"] == "nan" for s in nan_step)


def test_a_summary_the_record_refuses_is_sent_as_built_and_the_fault_logged_once(caplog):
    (summary, *_) = _summaries(steps=2)
    broken = {**summary, "step_seconds": -1.0}  # a collector bug: a negative period
    with caplog.at_level(logging.WARNING, logger="parwatch.collector"):
        first, second = encode_summary(broken), encode_summary(broken)
    assert json.loads(first) == _built(broken) and second == first  # nothing lost: the sidecar's 422 names it
    warned = [r.getMessage() for r in caplog.records if "does not fit its record" in r.getMessage()]
    assert len(warned) == 1 and "step_seconds" in warned[0]
