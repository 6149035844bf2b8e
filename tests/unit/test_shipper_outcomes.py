"""Rank 0's directive outcome records are never dropped: the leader hands out no other directive
until it has the outcome of the last one, so one lost record would hold a paused run for good."""

from __future__ import annotations

import json
import time

import msgspec

from parwatch.collector.shipper import Shipper
from parwatch.vocabulary import Outcome
from parwatch.wire.steps import OutcomeRecord
from tests.deadline import wait_until


class Reply:
    def __init__(self, status=200):
        self.status_code = status
        self.text = ""

    def json(self):
        return {"accepted": 1, "directive": None}


class FlakyPoster:
    """Fails the first `failures` posts (a sidecar restarting), then accepts everything."""

    def __init__(self, failures: int, status: int | None = None):
        self.failures, self.status = failures, status
        self.bodies: list[dict] = []

    def post(self, url, content, headers):
        if self.failures:
            self.failures -= 1
            if self.status is None:
                raise ConnectionError("sidecar restarting")
            return Reply(self.status)
        self.bodies.append(json.loads(content))
        return Reply()


def _wait(cond, timeout=20.0):
    wait_until(cond, "the condition", timeout, interval=0.02)


def _summary(step):
    return {"run_id": "r", "rank": 0, "step": step}


RECORD = OutcomeRecord(
    directive_id=7, run_id="r", outcome=Outcome.APPLIED, step=3, counts={Outcome.APPLIED: 4}, ranks=4
)
OUTCOME = msgspec.to_builtins(RECORD)
"""As the sidecar reads it."""


def test_an_outcome_that_fails_to_post_is_retried_until_accepted_even_with_no_summaries():
    poster = FlakyPoster(failures=1)
    shipper = Shipper(endpoint="http://sidecar", http=poster, max_backoff_s=0.2, poll_interval_s=60).start()
    try:
        shipper.put_outcome(RECORD)  # a paused run: no summaries flow to carry it
        # The poster keeps the body before the shipper reads the reply: wait for both.
        _wait(lambda: any(b.get("outcomes") == [OUTCOME] for b in poster.bodies) and not shipper.undelivered_outcomes())
        assert shipper.dropped == 0
        shipper.put_summary(_summary(4))  # summaries flow after it, without the record
        _wait(lambda: any(s["step"] == 4 for b in poster.bodies for s in b["summaries"]))
        assert sum("outcomes" in b for b in poster.bodies) == 1
    finally:
        shipper.close()


def test_an_outcome_rides_with_the_next_summaries():
    poster = FlakyPoster(failures=0)
    shipper = Shipper(endpoint="http://sidecar", http=poster)
    shipper._thread = object()  # no thread: post by hand
    shipper.put_outcome(RECORD)
    assert shipper._post(['{"step":5}'])
    assert poster.bodies == [{"version": 1, "summaries": [{"step": 5}], "outcomes": [OUTCOME]}]
    assert shipper.undelivered_outcomes() == 0


def test_an_outcome_never_rides_with_a_summary_put_before_it():
    # The leader reads a post's outcomes first: a step-9 summary of the timeline a rollback abandoned, sent
    # with the rollback's outcome, was judged as the replay's (still NaN after the rollback: a false pause).
    poster = FlakyPoster(failures=0)
    shipper = Shipper(endpoint="http://sidecar", http=poster)
    shipper._thread = object()  # no thread: drain by hand
    shipper.put_summary(_summary(9))
    shipper.put_outcome(RECORD)
    shipper.put_summary(_summary(5))
    shipper._drain()
    assert [(b["summaries"], b.get("outcomes")) for b in poster.bodies] == [
        ([_summary(9)], None),
        ([_summary(5)], [OUTCOME]),
    ]
    shipper.put_summary(_summary(6))
    shipper.put_outcome(RECORD)
    shipper._drain()  # nothing put after it: the outcome waits for the next post (a poll)
    assert "outcomes" not in poster.bodies[-1] and shipper.undelivered_outcomes() == 1


def test_outcomes_the_sidecar_refuses_as_invalid_are_given_up_not_retried_forever():
    poster = FlakyPoster(failures=1, status=422)
    shipper = Shipper(endpoint="http://sidecar", http=poster, max_backoff_s=0.2, poll_interval_s=60).start()
    try:
        shipper.put_outcome(RECORD)
        _wait(lambda: shipper.undelivered_outcomes() == 0)
        time.sleep(0.3)
        assert poster.bodies == []  # refused once, never sent again
    finally:
        shipper.close()


def test_outcomes_a_sidecar_refuses_for_the_token_are_kept_and_sent_once_it_takes_them():
    # 401 says nothing about the records: they were never read (a token fixed, a sidecar restarted).
    poster = FlakyPoster(failures=2, status=401)
    shipper = Shipper(endpoint="http://sidecar", http=poster, max_backoff_s=0.2, poll_interval_s=60).start()
    try:
        shipper.put_outcome(RECORD)
        _wait(lambda: any(b.get("outcomes") == [OUTCOME] for b in poster.bodies) and not shipper.undelivered_outcomes())
        assert poster.failures == 0
    finally:
        shipper.close()


class SlowPoster(FlakyPoster):
    def post(self, url, content, headers):
        time.sleep(0.2)
        return super().post(url, content, headers)


def test_flush_returns_once_every_summary_put_was_answered():
    """The run's end: rank 0 waits for the sidecar's answer on its last summaries, and no longer than asked."""
    poster = SlowPoster(failures=0)
    shipper = Shipper(endpoint="http://sidecar", http=poster, poll_interval_s=60).start()
    try:
        for step in (1, 2, 3):
            shipper.put_summary(_summary(step))
        assert shipper.flush(timeout_s=5.0)
        assert [s["step"] for b in poster.bodies for s in b["summaries"]] == [1, 2, 3]
        shipper.put_summary(_summary(4))
        assert not shipper.flush(timeout_s=0.05)  # the post takes 0.2 s: not answered yet
    finally:
        shipper.close()
    assert not Shipper(log_path=None).flush(timeout_s=1.0)  # no sidecar: nothing to wait for


class RefusingOne(FlakyPoster):
    """Takes every post but refuses its summary of step `step` alone, as the sidecar refuses a step ahead of
    the run (Store.admit): the answer's `refused` names its index."""

    def __init__(self, step: int):
        super().__init__(failures=0)
        self.step = step

    def post(self, url, content, headers):
        body = json.loads(content)
        self.bodies.append(body)
        held = [i for i, s in enumerate(body["summaries"]) if s["step"] == self.step]
        reply = Reply()
        reply.json = lambda: {  # type: ignore[method-assign]
            "accepted": len(body["summaries"]) - len(held),
            "refused": [{"index": i, "reason": f"summaries.{i}.step={self.step} is ahead of the run"} for i in held],
            "directive": None,
        }
        return reply


def test_a_summary_refused_alone_is_dropped_and_the_rest_of_its_post_is_taken():
    from parwatch.collector.shipper import Delivery

    poster = RefusingOne(step=3)
    shipper = Shipper(endpoint="http://sidecar", http=poster, poll_interval_s=60).start()
    deliveries = {step: Delivery() for step in (1, 2, 3, 4)}
    for step, delivery in deliveries.items():
        shipper.put_summary(_summary(step), delivery)
    try:
        _wait(lambda: all(d.accepted is not None for d in deliveries.values()))
        assert [s["step"] for b in poster.bodies for s in b["summaries"]] == [1, 2, 3, 4]
        assert {step: d.accepted for step, d in deliveries.items()} == {1: True, 2: True, 3: False, 4: True}
        assert (shipper.sent, shipper.dropped, shipper.refused) == (3, 1, 0)
    finally:
        shipper.close()


def test_a_post_refused_whole_as_invalid_drops_its_summaries_and_the_next_post_goes_at_once():
    """A 422 (or 400, 413) is the sidecar's answer about this body: it is reachable. Its summaries are
    refused, not "unreachable": no back-off holds the next, valid ones, and rank 0 is not told the sidecar
    is away."""
    from parwatch.collector.shipper import Delivery

    poster = FlakyPoster(failures=1, status=422)
    shipper = Shipper(endpoint="http://sidecar", http=poster, max_backoff_s=30, poll_interval_s=60)
    shipper._thread = object()  # no thread: post by hand
    first, second = Delivery(), Delivery()
    shipper.put_summary(_summary(1), first)
    shipper._drain()
    assert first.accepted is False and (shipper.dropped, shipper.refused) == (1, 1)
    assert shipper.unreachable_since is None
    shipper.put_summary(_summary(2), second)
    shipper._drain()  # at once: a back-off would drop it unsent
    assert second.accepted is True and [s["step"] for b in poster.bodies for s in b["summaries"]] == [2]
