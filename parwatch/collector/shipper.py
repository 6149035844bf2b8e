"""The shipper: everything slow happens here, on one daemon thread.

The training thread only appends to a bounded queue (`put_summary`,
`put_spans`): when the queue is full the oldest item is dropped and counted,
so training never waits. The thread writes summaries.jsonl and spans.jsonl,
POSTs summaries to the sidecar's /v1/ingest, and hands the directive of each
response to `on_directive`.

When the sidecar is away, summaries are dropped and counted (the JSONL file
still gets them) and attempts back off exponentially up to `max_backoff_s`;
the first success resets the backoff, so the shipper reconnects by itself.
A sidecar that refuses the token (HTTP 401/403) is no outage that passes: the first refusal
is logged as an error naming the fix and every summary it drops is counted in `refused` too;
`check_token` asks once, at attach, so a wrong or missing token can stop the run before it starts.
A summary put with a `Delivery` learns whether the sidecar took it (rank 0's local
guardrail, parwatch/collector/fallback.py, acts on a loss its sidecar never saw).
Rank 0 also polls (an ingest with no summaries) whenever it has posted nothing
for `poll_interval_s`: while the run is paused no summaries flow, and the
resume directive must still arrive. Rank 0's directive outcome records ride every
post until the sidecar has accepted one carrying them: they are few, and the leader
hands out no other directive before it has the outcome of the last one. The leader reads a
post's outcomes before its summaries, so an outcome never rides with a summary put before it
(after a rollback that would be a step of the abandoned timeline, judged as the replay's). Its records of the
steps the check before the optimizer step found bad ride the same way (`checks`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec

from parwatch.thread_names import daemon_thread
from parwatch.vocabulary import jsonable
from parwatch.wire.bounds import SCHEMA_VERSION
from parwatch.wire.steps import GlobalView, OutcomeRecord, StepCheckRecord, StepSummary

log = logging.getLogger("parwatch.collector")

SUMMARY, SPANS = "summary", "spans"
REFUSED_FOR_GOOD = frozenset({400, 404, 413, 422})
"""Answers after which rank 0's records are not sent again: the same body would be refused again."""
_ENCODER = msgspec.json.Encoder()
Prepare = Callable[[StepSummary, GlobalView | None], StepSummary]
"""The collector's last word on a summary, on the shipper's thread (its bubble causes): the summary to send."""


AUTH_FIX = (
    "pass the sidecar's token (Collector(token=...), read from the sidecar's --token-file or "
    "STATE_DIR/token; the collector mints this rank's credential from it), set PARWATCH_TOKEN "
    "(parwatch train: --parwatch-token-file), or the run's key in PARWATCH_RUN_KEY (parwatch credential)"
)


class Unauthorized(RuntimeError):
    """The sidecar refused this rank's token (HTTP 401/403); the message names the fix."""

    def __init__(self, url: str, status: int, detail: str) -> None:
        super().__init__(f"the sidecar at {url} refused this rank's token (HTTP {status}: {detail}); {AUTH_FIX}")


class Delivery:
    """What became of one summary: `accepted` is None while queued, then True (the sidecar took it)
    or False (dropped: the sidecar was away or refused it, or the queue overflowed). Written once by
    the shipper thread, read by the training thread: one attribute store, no lock."""

    __slots__ = ("accepted",)

    def __init__(self) -> None:
        self.accepted: bool | None = None


class Shipper:
    """Bounded queue + one thread: JSONL files and POST /v1/ingest."""

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        token: str | None = None,
        log_path: str | None = None,
        spans_path: str | None = None,
        queue_size: int = 1024,
        http=None,
        on_directive=None,
        poll_interval_s: float | None = None,
        prepare=None,
        batch_size: int = 64,
        connect_timeout_s: float = 0.5,
        timeout_s: float = 2.0,
        max_backoff_s: float = 5.0,
        time_fn=time.monotonic,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size={queue_size} must be at least 1")
        self.url = endpoint.rstrip("/") + "/v1/ingest" if endpoint else None
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._paths = {SUMMARY: log_path, SPANS: spans_path}
        self._files: dict = {}
        self._queue_size = queue_size
        self._queue: deque = deque()
        self._outcomes: deque = deque(maxlen=64)  # rank 0: (summaries put before it, encoded outcome) not yet accepted
        self._summaries_put = 0
        self._handled_through = 0  # the number of the last summary the thread posted or dropped
        self._checks: deque = deque(maxlen=64)  # rank 0: encoded step check records not yet accepted
        self.heartbeat_seen = False
        """Set by the collector on a completed heartbeat boundary; the next post says "alive"."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._http = http
        self._own_http = http is None
        self._on_directive = on_directive
        self.poll_interval_s = poll_interval_s
        self._prepare: Prepare | None = prepare
        self._batch_size = batch_size
        self._timeouts = (connect_timeout_s, timeout_s)
        self._max_backoff_s = max_backoff_s
        self._time = time_fn
        self._backoff = 0.0
        self._retry_at = 0.0
        self._last_post = -math.inf
        self._thread: threading.Thread | None = None
        self._told_refused = False
        self._refusing = False  # the last post was refused for the token
        self.dropped = 0
        """Summaries the sidecar never took: queue overflow, sidecar away or refusing (a post, or one summary)."""
        self.refused = 0
        """Of `dropped`: summaries the sidecar refused, for the token (HTTP 401/403) or as invalid (REFUSED_FOR_GOOD)."""
        self.sent = 0
        """Summaries the sidecar accepted."""
        self.unreachable_since: float | None = None
        """Wall-clock time of the first failed post of the current run of failures; None while posts succeed."""
        self._last_refusal = ""  # the last whole-post refusal logged
        self.cpu_ns = 0
        """The shipper thread's CPU time so far (time.thread_time_ns), as of its last round."""

    def check_token(self) -> None:
        """Raise Unauthorized if the sidecar refuses this rank's credential: one GET of its /v1/whoami (read
        only), on the calling thread, within the shipper's timeouts (a sidecar that accepts and never
        answers holds attach that long). Anything else passes (a sidecar still starting, one that is
        down or slow: the shipper reconnects by itself); so does a shipper given its own `http`."""
        if not self.url or not self._own_http:
            return
        import httpx

        connect, total = self._timeouts
        url = self.url.removesuffix("/v1/ingest") + "/v1/whoami"
        try:
            response = httpx.get(
                url, headers=self._headers, timeout=httpx.Timeout(total, connect=connect), trust_env=False
            )
        except httpx.HTTPError:
            return
        if response.status_code in (401, 403):
            raise Unauthorized(self.url, response.status_code, response.text[:200])

    @property
    def enabled(self) -> bool:
        return bool(self.url or self._paths[SUMMARY] or self._paths[SPANS])

    def start(self) -> Shipper:
        if self.url and self._http is None:
            # Import the HTTP stack now, at attach time: imported lazily on this thread at the
            # first post, it held the GIL long enough to stretch a training step (docs/benchmarks.md).
            import httpx  # noqa: F401
        if self.enabled and self._thread is None:
            self._thread = daemon_thread(self._run, "parwatch-shipper")
            self._thread.start()
        return self

    # Training thread: never blocks beyond one uncontended lock.
    def put_summary(
        self, summary: StepSummary, delivery: Delivery | None = None, view: GlobalView | None = None
    ) -> None:
        """`view`: another rank's own copy of the global view, for `prepare` (never sent)."""
        self._put((SUMMARY, (summary, view), delivery))

    def put_spans(self, records: list) -> None:
        if self._paths[SPANS]:
            self._put((SPANS, records, None))

    def _put(self, item) -> None:
        if self._thread is None or self._stopping:
            _settle([item[2]], False)
            return
        with self._lock:
            if len(self._queue) >= self._queue_size:
                kind, _payload, delivery, _ = self._queue.popleft()
                if kind == SUMMARY:  # (a dropped span list is just lost)
                    self.dropped += 1
                    _settle([delivery], False)
            if item[0] == SUMMARY:
                self._summaries_put += 1
            self._queue.append((*item, self._summaries_put))
        self._wake.set()

    def put_outcome(self, record: OutcomeRecord) -> None:
        """Rank 0: a directive's outcome record; sent with every post until one is accepted."""
        if self.url:
            with self._lock:
                self._outcomes.append((self._summaries_put, _ENCODER.encode(record).decode()))
            self._wake.set()

    def put_check(self, record: StepCheckRecord) -> None:
        """Rank 0: a bad step's record (the check before the optimizer step); sent until a post is accepted."""
        if self.url:
            with self._lock:
                self._checks.append(_ENCODER.encode(record).decode())
            self._wake.set()

    def queued(self) -> int:
        return len(self._queue)

    def flush(self, timeout_s: float) -> bool:
        """Training thread, after the run's last step: have every summary put so far posted (a directive
        in the answer reaches on_directive), waiting at most `timeout_s`; True when they were."""
        if not self.url or self._thread is None:
            return False
        with self._lock:
            target = self._summaries_put
        self._wake.set()
        deadline = self._time() + timeout_s
        while self._handled_through < target:
            if self._time() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(0.005)
        return True

    def undelivered_outcomes(self) -> int:
        """Outcome records the sidecar has not accepted yet."""
        return len(self._outcomes)

    # Shipper thread.
    def _run(self) -> None:
        try:
            while True:
                wait = self.poll_interval_s or 0.5
                if self._outcomes or self._checks:  # a record waits for nothing but the backoff
                    wait = min(wait, max(0.05, self._retry_at - self._time()))
                self._wake.wait(wait)
                self._wake.clear()
                stopping = self._stopping
                self._drain()
                if self._poll_due() or ((self._outcomes or self._checks) and self._time() >= self._retry_at):
                    self._post([])
                self.cpu_ns = time.thread_time_ns()  # parwatch's own cost; one int store, read by the collector
                if stopping:
                    self._drain()
                    break
        finally:
            self._cleanup()

    def _drain(self) -> None:
        while True:
            with self._lock:
                items = list(self._queue)
                self._queue.clear()
            if not items:
                return
            last = items[-1][3]
            # Encode each summary once: the same text goes to the file and into the POST body.
            summaries = [self._encode(*payload) for kind, payload, _, _ in items if kind == SUMMARY]
            deliveries = [delivery for kind, _, delivery, _ in items if kind == SUMMARY]
            numbers = [n for kind, _, _, n in items if kind == SUMMARY]
            self._write(SUMMARY, summaries)
            if self._paths[SPANS]:
                self._write(SPANS, [_dumps(r) for kind, payload, _, _ in items if kind == SPANS for r in payload])
            if not self.url:
                _settle(deliveries, False)
                self._handled_through = last
                continue
            with self._lock:  # a post ends where an outcome was put: what came before it goes without it
                marks = {put for put, _ in self._outcomes}
            i = 0
            while i < len(summaries):
                end = min(len(summaries), i + self._batch_size)
                end = next((j for j in range(i + 1, end) if any(numbers[j - 1] <= m < numbers[j] for m in marks)), end)
                for delivery, taken in zip(deliveries[i:end], self._post(summaries[i:end], numbers[i])):
                    _settle([delivery], taken)
                i = end
            self._handled_through = last

    def _encode(self, summary: StepSummary, view: GlobalView | None) -> str:
        if self._prepare is not None:
            try:
                summary = self._prepare(summary, view)
            except Exception:  # a summary without its extras beats no summary
                pass
        return _ENCODER.encode(summary).decode()

    def _write(self, kind: str, lines: list) -> None:
        path = self._paths[kind]
        if not path or not lines:
            return
        try:
            fd = self._files.get(kind)
            if fd is None:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                fd = self._files[kind] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            # One write() per batch on an O_APPEND descriptor: the ranks of a run share one file
            # and whole lines never interleave.
            data = ("\n".join(lines) + "\n").encode()
            while data:
                data = data[os.write(fd, data) :]
        except OSError as exc:
            log.warning("parwatch: cannot write %s (%s); %s writing stops for this rank", path, exc, kind)
            self._paths[kind] = None

    def _refused_whole(self, summaries: list, why: str) -> list[bool]:
        """The sidecar answered and refused the whole body as invalid: its summaries are dropped as refused.
        No back-off (the next post is another body, and a back-off would drop it unsent) and not
        `unreachable_since`; its outcome and check records ride the next post (refused alone, given up)."""
        with self._lock:
            self.dropped += len(summaries)
        self.refused += len(summaries)
        if why != self._last_refusal:  # once per reason: a sidecar refusing every post would log every step
            self._last_refusal = why
            log.warning("parwatch: the sidecar refused a post of %d summaries (%s)", len(summaries), why)
        return [False] * len(summaries)

    def _poll_due(self) -> bool:
        if not self.url or self.poll_interval_s is None:
            return False
        now = self._time()
        return now - self._last_post >= self.poll_interval_s and now >= self._retry_at

    def _client(self):
        if self._http is None:
            import httpx

            connect, total = self._timeouts
            # trust_env=False: the sidecar is on this host or pod network; an HTTP(S)_PROXY meant
            # for the internet must not capture it.
            self._http = httpx.Client(timeout=httpx.Timeout(total, connect=connect), trust_env=False)
        return self._http

    def _post(self, summaries: list, first: int | None = None) -> list[bool]:
        """POST summaries (already JSON text; `first`: the number of the first, as put), with the outcome
        records put before it (every one without summaries), as one ingest body; whether the sidecar took
        each summary."""
        now = self._time()
        if now < self._retry_at:  # sidecar away or refusing: do not wait for it
            with self._lock:
                self.dropped += len(summaries)
            if self._refusing:
                self.refused += len(summaries)
            return [False] * len(summaries)
        alive, self.heartbeat_seen = self.heartbeat_seen, False
        with self._lock:
            outcomes = [text for put, text in self._outcomes if first is None or put < first]
            checks = list(self._checks)
        tail = (
            (f',"outcomes":[{",".join(outcomes)}]' if outcomes else "")
            + (f',"checks":[{",".join(checks)}]' if checks else "")
            + (',"alive":true}' if alive else "}")
        )
        body = (f'{{"version":{SCHEMA_VERSION},"summaries":[{",".join(summaries)}]' + tail).encode()
        try:
            response = self._client().post(self.url, content=body, headers=self._headers)
            if response.status_code in (401, 403):  # before the outcome rule: they were never read
                raise Unauthorized(str(self.url), response.status_code, response.text[:200])
            if (outcomes or checks) and response.status_code in REFUSED_FOR_GOOD and not summaries:
                # Refused as invalid: retrying the same records cannot succeed; say so and move on. (A
                # conflict or a limit, 409 or 429, may pass later: the records are sent again.)
                log.warning(
                    "parwatch: sidecar refused outcome or check records (HTTP %s: %s)",
                    response.status_code,
                    response.text[:200],
                )
                self._forget_outcomes(len(outcomes), len(checks))
                return []
            if response.status_code in REFUSED_FOR_GOOD:  # reachable, and these summaries refused for good
                return self._refused_whole(summaries, f"HTTP {response.status_code}: {response.text[:200]}")
            if response.status_code >= 400:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            reply = response.json()
        except Exception as exc:
            with self._lock:
                self.dropped += len(summaries)
            self._refusing = isinstance(exc, Unauthorized)
            if self._refusing:
                self.refused += len(summaries)
                if not self._told_refused:  # the run goes on unwatched: say so loudly, once
                    self._told_refused = True
                    log.error("parwatch: %s; dropping every summary until it is fixed", exc)
            elif self._backoff == 0.0:
                log.warning(
                    "parwatch: sidecar at %s unreachable (%s); dropping summaries until it is back", self.url, exc
                )
            if self.unreachable_since is None:
                self.unreachable_since = time.time()
            self._backoff = min(self._max_backoff_s, self._backoff * 2 if self._backoff else 0.25)
            self._retry_at = self._time() + self._backoff
            return [False] * len(summaries)
        if self._backoff:
            log.warning("parwatch: sidecar at %s reachable again", self.url)
        self._backoff = self._retry_at = 0.0
        self._refusing = False
        self.unreachable_since = None
        self._last_post = self._time()
        taken = [True] * len(summaries)
        held = (reply.get("refused") or []) if isinstance(reply, dict) else []
        for entry in held if isinstance(held, list) else ():
            index = entry.get("index") if isinstance(entry, dict) else None
            if isinstance(index, int) and 0 <= index < len(taken):
                taken[index] = False  # refused alone (a step ahead of the run), the post's others taken
        if False in taken:
            log.warning(
                "parwatch: the sidecar refused %d of a post's %d summaries, the rest taken: %s",
                taken.count(False),
                len(taken),
                str(held[0].get("reason") if isinstance(held[0], dict) else held[0])[:200],
            )
        with self._lock:
            self.dropped += taken.count(False)
        self.sent += taken.count(True)
        self._forget_outcomes(len(outcomes), len(checks))
        directive = reply.get("directive") if isinstance(reply, dict) else None
        if self._on_directive is not None:
            try:
                self._on_directive(directive)
            except Exception as exc:
                log.warning("parwatch: ignoring directive %r (%s)", directive, exc)
        return taken

    def _forget_outcomes(self, n: int, checks: int = 0) -> None:
        with self._lock:
            for records, sent in ((self._outcomes, n), (self._checks, checks)):
                for _ in range(min(sent, len(records))):
                    records.popleft()

    def _cleanup(self) -> None:
        with self._lock:  # what was still queued at the end never reached the sidecar
            _settle([delivery for _, _, delivery, _ in self._queue], False)
        for fd in self._files.values():
            try:
                os.close(fd)
            except OSError:
                pass
        if self._own_http and self._http is not None:
            with contextlib.suppress(Exception):
                self._http.close()

    def close(self, timeout: float = 2.0) -> None:
        """Write and send what is queued (best effort within `timeout`), then stop the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)


def _dumps(value) -> str:
    """Compact JSON of a span record (its attrs are the trainer's)."""
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except ValueError:  # a non-finite float the trainer did not encode
        return json.dumps(jsonable(value), allow_nan=False, separators=(",", ":"))


def _settle(deliveries, accepted: bool) -> None:
    for delivery in deliveries:
        if delivery is not None:
            delivery.accepted = accepted
