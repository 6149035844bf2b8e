"""Acknowledgements are never dropped: the sidecar hands out no other directive until every rank
acknowledged, so one lost ack would hold a paused run for good."""

from __future__ import annotations

import json
import time

from parwatch.collector.shipper import Shipper


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
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _summary(step, applied=()):
    return {"run_id": "r", "rank": 1, "step": step, "applied": list(applied)}


def test_an_ack_that_fails_to_post_is_retried_until_accepted_and_not_counted_as_dropped():
    poster = FlakyPoster(failures=1)
    shipper = Shipper(endpoint="http://sidecar", http=poster, max_backoff_s=0.2).start()
    try:
        shipper.put_summary(_summary(3, applied=[{"id": 7, "step": 3}]))
        _wait(lambda: any(s["applied"] for b in poster.bodies for s in b["summaries"]))
        assert shipper.dropped == 0 and shipper.undelivered_acks() == 0
        shipper.put_summary(_summary(4))  # ordinary summaries still flow after it
        _wait(lambda: any(s["step"] == 4 for b in poster.bodies for s in b["summaries"]))
    finally:
        shipper.close()


def test_an_ack_pushed_out_of_a_full_queue_is_kept_for_delivery():
    poster = FlakyPoster(failures=0)
    shipper = Shipper(endpoint="http://sidecar", http=poster, queue_size=2)
    shipper._thread = object()  # accept puts without a running thread, so the queue overflows
    shipper.put_summary(_summary(1, applied=[{"id": 9, "step": 1}]))
    shipper.put_summary(_summary(2))
    shipper.put_summary(_summary(3))
    assert shipper.queued() == 2 and shipper.undelivered_acks() == 1 and shipper.dropped == 0


def test_acks_the_sidecar_refuses_as_invalid_are_given_up_not_retried_forever():
    poster = FlakyPoster(failures=1, status=400)
    shipper = Shipper(endpoint="http://sidecar", http=poster, max_backoff_s=0.2).start()
    try:
        shipper.put_summary(_summary(3, applied=[{"id": 7, "step": 3}]))
        _wait(lambda: shipper.undelivered_acks() == 0 and shipper.dropped == 1)
    finally:
        shipper.close()
