"""The activity reporter: what it reads from registry.current (nested spans), its payload, its
replies (abort), its last word on close; and the hang fault specs."""

import json
import os
import signal
import time
from types import SimpleNamespace

import pytest

from parwatch import contract
from parwatch.collector.activity import ActivityReporter
from parwatch.collector.context import RunContext
from parwatch.trainer.errors import ConfigError
from parwatch.trainer.faults import Faults, parse_fault
from parwatch.wire.activity import HANG_EXIT_CODE, ActivityPost
from parwatch.wire.codec import decode


class Response:
    def __init__(self, body, status=200):
        self.status_code, self._body, self.text = status, body, json.dumps(body)

    def json(self):
        return self._body


class FakeHttp:
    def __init__(self, reply=None):
        self.posts, self.reply = [], reply or {"ok": True}

    def post(self, url, content, headers):
        self.posts.append((url, json.loads(content), headers))
        return Response(self.reply)

    def close(self):
        pass


def _ctx(rank=3):
    return RunContext.for_rank("run-1", rank, tp=2, pp=2, dp=1, schedule="1f1b", microbatches=4, hostname="node-a")


def test_registry_current_follows_nested_spans():
    reg = contract.HookRegistry()
    reg.register(contract.Observer())
    assert reg.current is None
    with reg.span(contract.SpanKind.FORWARD, stage=1) as fwd:
        assert reg.current is fwd
        with reg.span(contract.SpanKind.COLLECTIVE, op="all_reduce", group="tp", seq=3) as coll:
            assert reg.current is coll
        assert reg.current is fwd  # back to the enclosing span
    assert reg.current is None


def test_snapshot_names_the_open_span_and_since_when():
    reg = contract.HookRegistry()
    reg.register(contract.Observer())
    now_ns = [10_000_000_000]
    rep = ActivityReporter(
        _ctx(),
        reg,
        "http://x",
        time_fn=lambda: 500.0,
        perf_ns=lambda: now_ns[0],
        summary_fn=lambda: SimpleNamespace(step=41, step_seconds=0.25, time=None),
        pid=4242,
    )
    idle = rep.snapshot()
    assert idle.kind is None and idle.step == 41 and idle.error is None
    assert idle.step_end is None  # this summary has no time: the leader falls back on the sample's
    with reg.span(contract.SpanKind.COLLECTIVE, op="all_reduce", group="tp", seq=17) as span:
        span.start = now_ns[0] - 2_500_000_000  # opened 2.5 s ago
        a = rep.snapshot()
    assert (a.kind, a.op, a.group, a.seq) == ("collective", "all_reduce", "tp", 17)
    assert a.since == pytest.approx(497.5)
    assert (a.rank, a.stage, a.tp_rank, a.dp_rank, a.host, a.pid) == (3, 1, 1, 0, "node-a", 4242)


def test_post_body_token_and_abort_reply():
    reg = contract.HookRegistry()
    exits = []
    http = FakeHttp({"ok": True, "abort": HANG_EXIT_CODE})
    rep = ActivityReporter(_ctx(), reg, "http://side:9401/", token="s3cret", http=http, on_abort=exits.append)
    assert rep.post(rep.snapshot())
    url, body, headers = http.posts[0]
    assert url == "http://side:9401/v1/activity" and body["version"] == 1 and body["activity"]["rank"] == 3
    assert headers["Authorization"] == "Bearer s3cret"
    assert exits == [HANG_EXIT_CODE]
    assert len(json.dumps(body)) < 600  # tiny


def test_what_the_reporter_posts_decodes_as_the_sidecar_reads_it():
    """The collector encodes parwatch.wire.activity.ActivityPost; the sidecar decodes the same type, every bound
    checked: a span's report, and the last word of a rank that crashed with a multi-line, tabbed error."""
    http = FakeHttp()
    reg = contract.HookRegistry()
    reg.register(contract.Observer())
    rep = ActivityReporter(
        _ctx(),
        reg,
        "http://x",
        http=http,
        interval_s=600,
        summary_fn=lambda: SimpleNamespace(step=4, step_seconds=None, time=12.5),
    ).start()
    with reg.span(contract.SpanKind.RECV, op="recv", group="pp", peer=1, seq=2):
        assert rep.post(rep.snapshot())
    rep.close(error=RuntimeError("NCCL\terror:\x1b[31m boom\nsecond line"))
    posted = [decode(json.dumps(body).encode(), ActivityPost, "").activity for _, body, _ in http.posts]
    assert len(posted) == 3  # the thread's first report (at once, then every 600 s), the span's, the last word
    a = next(a for a in posted if a.kind == "recv")
    assert (a.kind, a.peer, a.seq, a.step, a.step_end, a.state) == ("recv", 1, 2, 4, 12.5, "running")
    crashed = posted[-1]
    assert crashed.state == "crashed" and crashed.error == "RuntimeError: NCCL error: [31m boom"


def test_thread_reports_about_once_a_second_and_says_done_on_close():
    http = FakeHttp()
    rep = ActivityReporter(_ctx(), contract.HookRegistry(), "http://x", interval_s=0.05, http=http).start()
    deadline = time.monotonic() + 10
    while len(http.posts) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    rep.close()
    assert len(http.posts) >= 4 and http.posts[-1][1]["activity"]["state"] == "done"


def test_unreachable_sidecar_backs_off_without_raising():
    class Down(FakeHttp):
        def post(self, *a, **k):
            raise ConnectionError("refused")

    rep = ActivityReporter(_ctx(), contract.HookRegistry(), "http://x", http=Down())
    assert not rep.post(rep.snapshot()) and not rep.post(rep.snapshot())  # the second is skipped (backoff)
    assert rep.failed == 2


def test_stack_dump_on_sigusr1(tmp_path):
    path = tmp_path / "run" / "stacks-rank3.txt"
    ActivityReporter(_ctx(), contract.HookRegistry(), None, stacks_path=str(path)).start()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while "Thread" not in (path.read_text() if path.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "test_stack_dump_on_sigusr1" in path.read_text()
    finally:
        import faulthandler

        faulthandler.unregister(signal.SIGUSR1)


def test_hang_fault_specs():
    assert parse_fault("hang:rank=1,step=5").params == {"rank": 1, "step": 5, "where": "compute"}
    assert parse_fault("hang:rank=0,step=2,where=send").params["where"] == "send"
    with pytest.raises(ConfigError, match="where='gpu' is not one of compute, collective, send"):
        parse_fault("hang:rank=1,step=5,where=gpu")
    with pytest.raises(ConfigError, match="missing step"):
        parse_fault("hang:rank=1")
    f = Faults([parse_fault("hang:rank=1,step=5,where=collective")], rank=1, stage=0)
    f.begin_step(4)
    assert not f.hang_due("collective")
    f.begin_step(5)
    assert f.hang_due("collective") and not f.hang_due("compute")
    assert not Faults([parse_fault("hang:rank=1,step=5")], rank=0, stage=0).hang_due("compute")


def test_snapshot_carries_when_the_step_ended():
    """step_end is the summary's time: the rank's wall clock at its step boundary, where the leader
    starts a stall's clock (parwatch.sidecar.hang.Progress.boundary_time)."""
    rep = ActivityReporter(
        _ctx(),
        contract.HookRegistry(),
        "http://x",
        time_fn=lambda: 500.9,
        summary_fn=lambda: SimpleNamespace(step=7, step_seconds=0.25, time=500.125),
    )
    a = rep.snapshot()
    assert (a.step, a.step_end, a.time) == (7, 500.125, 500.9)
    assert rep.snapshot().step_end <= a.time


def test_parwatch_host_overrides_the_host_a_rank_reports(monkeypatch):
    """Kubernetes: a container's hostname is its pod's name; $PARWATCH_HOST (the chart sets it from
    spec.nodeName) makes two pods of one node one host, for host-contention attribution."""
    import socket

    from parwatch.host import host_identity

    monkeypatch.delenv("PARWATCH_HOST", raising=False)
    assert host_identity() == socket.gethostname()
    monkeypatch.setenv("PARWATCH_HOST", " gpu-node-17 ")
    assert host_identity() == "gpu-node-17"
    ctx = RunContext.for_rank("run-1", 0, tp=1, pp=2, dp=1, schedule="1f1b", microbatches=4)
    assert ctx.hostname == "gpu-node-17"
    rep = ActivityReporter(ctx, contract.HookRegistry(), "http://x")
    assert rep.snapshot().host == "gpu-node-17"
    monkeypatch.setenv("PARWATCH_HOST", "two words")
    with pytest.raises(ValueError, match=r"\$PARWATCH_HOST='two words' must be a host name"):
        host_identity()


def test_straggler_by_rank():
    f = parse_fault("straggler:rank=2,ms=20")
    assert f.params == {"rank": 2, "ms": 20.0}
    assert Faults([f], rank=2, stage=1).straggler_ms(1) == 20.0
    assert Faults([f], rank=3, stage=1).straggler_ms(1) == 0.0
    both = parse_fault("straggler:stage=1,rank=2,ms=5")
    assert Faults([both], rank=2, stage=0).straggler_ms(1) == 0.0  # both must match
    assert Faults([parse_fault("straggler:stage=1,ms=5")], rank=7, stage=1).straggler_ms(1) == 5.0
    with pytest.raises(ConfigError, match="missing stage"):
        parse_fault("straggler:ms=5")


def test_the_first_report_goes_at_start_not_an_interval_later():
    """So the sidecar knows (and watches) the rank's process from attach: a rank torchrun started that died
    at step 6, before its first report a second in, was "never seen" in CI and no culprit was named."""
    rep, http = _reporting_every_600_s()
    rep.close()
    assert len(http.posts) == 2  # the first report, then the last word; none in between (600 s)


def _reporting_every_600_s() -> tuple[ActivityReporter, FakeHttp]:
    """A started reporter with a 600 s interval, once its first report went."""
    http = FakeHttp()
    rep = ActivityReporter(_ctx(), contract.HookRegistry(), "http://x", interval_s=600, http=http).start()
    _wait_for_posts(http, 1)
    return rep, http


def _wait_for_posts(http: FakeHttp, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(http.posts) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_collectors_first_activity_sample_at_attach_does_not_fail(caplog):
    """The reporter's first sample (at attach, on its own thread) reads the collector's last summary. It
    was set after the reporter started, so that sample failed with an AttributeError (71 of the 72 trainer
    logs of one suite run said "activity sample failed") and the report at attach never went."""
    import logging

    from parwatch.collector import Collector, RunContext
    from parwatch.ports import free_port

    ctx = RunContext.for_rank("r", 0, tp=1, pp=2, dp=1, schedule="1f1b", microbatches=2)
    with caplog.at_level(logging.WARNING, logger="parwatch"):
        collector = Collector(ctx, endpoint=f"http://127.0.0.1:{free_port()}")  # nobody listens: a refused post
        time.sleep(0.3)  # the first sample is taken at once
        collector.close(timeout=1.0)
    assert "activity sample failed" not in caplog.text, caplog.text


def test_a_long_step_ended_is_reported_at_once_not_an_interval_later():
    """The quick campaign (a venv run, healthy-long-steps, 0.49 s steps, bound 2.75 s) named a hang: rank 1's
    1.5 s hiccup lasted 2.03 s under load, its step ended 2.51 s after the boundary, and no report said so
    before the 2.75 s line. A step longer than the interval now wakes the reporter at its boundary."""
    rep, http = _reporting_every_600_s()
    rep.report_soon()
    _wait_for_posts(http, 2)
    assert len(http.posts) == 2  # the first report, then the one asked for, long before 600 s
    rep.close()
    assert len(http.posts) == 3  # and the last word


def test_the_end_of_a_long_activity_is_reported_at_once_not_an_interval_later():
    """The leader counts a stall from a checkpoint save's or an eval pass's end: the first report out of it
    goes when it ends (seed 46's healthy run named a 1.5 s hiccup right after an eval a hang, its last busy
    report sampled up to a second before the eval ended)."""
    http = FakeHttp()
    reg = contract.HookRegistry()
    reg.register(SimpleNamespace(on_span=lambda span: None))
    rep = ActivityReporter(_ctx(), reg, "http://x", interval_s=600, http=http)
    with reg.span(contract.SpanKind.EVAL):
        rep.start()
        _wait_for_posts(http, 1)
        assert http.posts[0][1]["activity"]["busy"] == "eval"
    _wait_for_posts(http, 2)  # its end: long before 600 s
    assert len(http.posts) == 2 and http.posts[1][1]["activity"]["busy"] is None
    time.sleep(0.2)
    assert len(http.posts) == 2  # then an interval again, not a report a tick
    rep.close()
