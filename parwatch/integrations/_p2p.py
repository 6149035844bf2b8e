"""send/recv spans for torch pipelining: the one module-level hook the schedules share.

torch batches a stage's point-to-point ops privately: every schedule posts them through
`schedules._batch_p2p(ops)` and blocks in `schedules._wait_batch_p2p(works)` (both looked up
as module globals at call time, so replacing them reaches every schedule class). The stage
methods that build the ops (`get_fwd_send_ops` ...) are public; the integration tags the ops
they return, and these two wrappers time only tagged batches:

- recv: from entering the wait to its return (the time the rank could not compute); while it waits it is
  the rank's open span (`registry.current`), so the activity reporter says what the rank waits on;
- send: from posting to the end of the first wait that finds it complete (an upper bound: a
  send is only known complete when the schedule waits for it).

Untagged batches (another schedule not being watched) pass straight through. Installed once
per process however many schedules are watched (reference counted).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from parwatch.contract import Span, SpanKind, registry

TAG = "_parwatch_p2p"
REQUIRED = ("_batch_p2p", "_wait_batch_p2p")

_lock = threading.Lock()
_users = 0
_originals: dict[str, Callable[..., Any]] = {}


class P2PHookMissing(RuntimeError):
    """The installed torch lacks the private functions the send/recv spans hook."""


class _Timed(list):
    """The works of one tagged batch, with when it was posted and its spans (marks set at the wait)."""

    __slots__ = ("posted", "spans")
    posted: Any
    """Clock mark when the batch was posted."""
    spans: list[Span] | tuple[()]
    """Its send and recv spans; () once a wait has reported them."""


_RECV = SpanKind.RECV
_new = object.__new__


def _batch_p2p(p2p_ops, desc=None):
    # Runs right after the thread wakes (a receive, a compute's sleep), when each Python call and
    # object costs 5-10x its cost in a loop: the span is built here with as few of both as it can,
    # and after the ops are posted, so the peer's receive is not kept waiting for it.
    original = _originals["_batch_p2p"]
    reg = registry
    if not reg.active:
        return original(p2p_ops, desc=desc)
    posted = reg.clock.mark()
    works = original(p2p_ops, desc=desc)
    spans = None
    for op in p2p_ops:
        tag = getattr(op, TAG, None)
        if tag is not None:
            kind, attrs = tag  # what does not change between steps (see _stage_spans._tagging)
            attrs = attrs.copy()
            attrs["peer"] = op.peer
            attrs["bytes"] = op.tensor.nbytes
            attrs["seq"] = reg.next_seq(kind, attrs)  # numbered when posted: the program's order
            span = _new(Span)
            span.kind, span.attrs, span.parent = kind, attrs, None
            if spans is None:
                spans = []
            spans.append(span)
    if spans is None:
        return works
    timed = _Timed(works)
    timed.posted = posted
    timed.spans = spans
    return timed


def _wait_batch_p2p(work):
    original = _originals["_wait_batch_p2p"]
    reg = registry
    if type(work) is not _Timed or not reg.active:
        return original(work)
    mark = reg.clock.mark
    start = mark()
    posted = work.posted
    spans = work.spans
    # While it blocks, the rank's activity is this wait (its recv, else its first send): a hung peer's
    # waiters are named by what they wait on, not read as "between spans".
    waited = None
    for span in spans:
        if waited is None or span.kind is _RECV:
            waited = span
    if waited is not None:
        waited.start = start if waited.kind is _RECV else posted
        waited.parent, reg.current = reg.current, waited
    try:
        result = original(work)
    finally:
        if waited is not None:
            reg.current, waited.parent = waited.parent, None
    end = mark()
    sinks = reg.sinks
    for span in spans:
        span.start = start if span.kind is _RECV else posted
        span.end = end
        for on_span in sinks:
            on_span(span)
    work.spans = ()  # a second wait on the same batch reports nothing twice
    return result


def install() -> None:
    """Put the timing wrappers in torch's schedules module (first caller only)."""
    global _users
    from torch.distributed.pipelining import schedules

    with _lock:
        if _users == 0:
            missing = [name for name in REQUIRED if not callable(getattr(schedules, name, None))]
            if missing:
                import torch

                raise P2PHookMissing(
                    f"torch {torch.__version__}: torch.distributed.pipelining.schedules has no "
                    f"{', '.join(missing)}; parwatch's send/recv spans hook them (present in torch 2.13). "
                    "Watch with p2p=False to go without send/recv spans, or pin a torch that has them."
                )
            for name, wrapper in (("_batch_p2p", _batch_p2p), ("_wait_batch_p2p", _wait_batch_p2p)):
                _originals[name] = getattr(schedules, name)
                setattr(schedules, name, wrapper)
        _users += 1


def uninstall() -> None:
    """Undo `install` once every watcher has gone (leaves another library's later patch alone)."""
    global _users
    from torch.distributed.pipelining import schedules

    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users == 0:
            for name, wrapper in (("_batch_p2p", _batch_p2p), ("_wait_batch_p2p", _wait_batch_p2p)):
                if getattr(schedules, name, None) is wrapper:
                    setattr(schedules, name, _originals[name])
            _originals.clear()
