"""The trainer's window to the outside world: parwatch's instrumentation contract.

The trainer announces what it does through `parwatch.contract` (spans, events, the
step boundary) and imports nothing else of parwatch. The names below are kept so
`hooks.FORWARD`, `hooks.registry` read as before; each is the contract's own object.
"""

from parwatch.contract import (  # noqa: F401  (re-exported)
    COMPUTE_KINDS,
    OTHER_KINDS,
    BoundaryInfo,
    Clock,
    Event,
    HookRegistry,
    Observer,
    PerfCounterClock,
    Span,
    SpanKind,
    registry,
)
from parwatch.contract.spans import _NULL_SPAN  # noqa: F401  (tests check the no-observer fast path)

FORWARD = SpanKind.FORWARD
BACKWARD = SpanKind.BACKWARD
SEND = SpanKind.SEND
RECV = SpanKind.RECV
COLLECTIVE = SpanKind.COLLECTIVE
OPTIMIZER = SpanKind.OPTIMIZER
DP_SYNC = SpanKind.DP_SYNC
CHECKPOINT = SpanKind.CHECKPOINT
DATA = SpanKind.DATA
BOUNDARY = SpanKind.BOUNDARY
