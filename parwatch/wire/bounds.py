"""The wire's bounds: one set, for every record that crosses a process boundary.

- A run's layout: tp, pp, dp and their product, the world, are at most MAX_WORLD (above the largest runs
  published), so every loop the leader runs over a run's ranks is bounded; a rank, a stage, a list of a
  run's ranks or stages stays inside it. A summary and an activity report accept the same layouts.
- Steps, checkpoint steps, directive ids and skip counts: below the contract's MAX_STEP (2**53), since
  they travel in the float64 step-boundary vector; an activity report's last step may be -1 (none yet).
- Counts (bytes, collective calls, sequence numbers) are exported as float64 samples: at most MAX_COUNT.
- Seconds and ratios are finite and bounded (a sum of many stays finite); text that becomes a label value
  or a log line is short and has no control characters.
Stored data therefore can never make a /metrics scrape fail (tests/unit/test_sidecar_properties.py). What
depends on the run (a rank inside its [tp, pp, dp]) is checked in `__post_init__` or by the sidecar.

A loss, or any float that may be non-finite, travels as a number or one of the strings "nan", "inf",
"-inf" (parwatch.vocabulary.jsonable writes them; `decode_float` reads them).
"""

from __future__ import annotations

from typing import Annotated, Final

from msgspec import Meta

from parwatch.contract.directives import MAX_STEP as MAX_STEP  # the contract's (stdlib) bound, one definition
from parwatch.rank_layout import ORDERS

SCHEMA_VERSION: Final = 1
"""Every body's `version` (a summary's `v`)."""

MAX_WORLD = 1 << 17
MAX_COUNT = 2**53
"""Exported as a float64 sample, so float-exact (and it fits int64)."""
MAX_SECONDS = 1e9
"""Largest duration (about 31 years)."""
MAX_RATIO = 1e6
MAX_TIME = 1e11
"""Largest unix time (year 5138)."""
MAX_PID = 1 << 22  # Linux's pid_max ceiling
MAX_TEXT = 64  # a span kind, op or group as an activity report names it
MAX_HOST = 253  # a DNS name
MAX_NODE = MAX_HOST + 6  # host:port
MAX_RUN_ID = 128
MAX_ERROR_CHARS = 200
"""A crashed rank's error text is cut to this many characters by the rank and checked by the sidecar."""
MAX_CHECKPOINTS = 1000
"""Checkpoint steps a summary (and the engine's state) carries: the newest ones."""
MAX_TIMELINE = 100_000
"""Rollbacks applied in one run (a summary's timeline) at most."""

# How far a run can move: reports past these are refused, never taken as the run's newest state.
MAX_STEPS_PER_SECOND = 1000.0
"""Faster than any training run's steps: a summary or activity report that moves its rank further ahead of
the run's highest step than this pace allows since that step was first seen is refused (a forged step
10^9 would otherwise make every real rank look stalled behind it, or freeze the newest view)."""
MAX_ROLLBACKS_PER_SECOND = 1.0
"""Faster than a run can load checkpoints: a timeline further ahead of the run's highest than this pace
allows since that timeline was first seen is refused (2^31 would otherwise stand as the newest forever)."""

CONTROL_CHARS = r"[\x00-\x1f\x7f-\x9f\u2028\u2029]"
"""Text that reaches logs and labels has none of these."""
PRINTABLE = "^[^" + CONTROL_CHARS[1:-1] + "]*"
PYTHON_END, ECMA_END = r"\Z", "$"
"""Python's re (msgspec checks with it) also matches $ before a final newline; the schema's ECMA regex has no \\Z."""


def text(max_length: int, min_length: int = 0, description: str | None = None) -> Meta:
    """A printable string: no control characters (they would forge log lines and break labels)."""
    return Meta(min_length=min_length, max_length=max_length, pattern=PRINTABLE + PYTHON_END, description=description)


Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
SignedCount = Annotated[int, Meta(ge=-MAX_COUNT, le=MAX_COUNT)]
Rank = Annotated[int, Meta(ge=0, lt=MAX_WORLD)]
"""A rank or a stage: inside the largest world."""
Ranks = Annotated[int, Meta(ge=0, le=MAX_WORLD)]
"""A number of ranks (an outcome's count of them)."""
Parallel = Annotated[int, Meta(ge=1, le=MAX_WORLD, description="tp, pp or dp: at least 1")]
RankList = Annotated[list[Rank], Meta(max_length=MAX_WORLD)]
Step = Annotated[int, Meta(ge=0, lt=MAX_STEP)]
"""A step, checkpoint step, directive id or skip count: the contract's bound (parse_directive)."""
LastStep = Annotated[int, Meta(ge=-1, lt=MAX_STEP, description="the last completed step (-1 before the first)")]
Timeline = Annotated[int, Meta(ge=0, le=MAX_TIMELINE)]
"""Rollbacks applied so far in a run."""
Pid = Annotated[int, Meta(ge=0, le=MAX_PID)]
Seconds = Annotated[float, Meta(ge=0, le=MAX_SECONDS)]
SignedSeconds = Annotated[float, Meta(ge=-MAX_SECONDS, le=MAX_SECONDS)]
LedgerSeconds = Annotated[float, Meta(ge=0, le=MAX_SECONDS * 100)]
"""A rank's cumulative seconds in one ledger category: up to ~3,000 years."""
Ratio = Annotated[float, Meta(ge=-MAX_RATIO, le=MAX_RATIO)]
Bandwidth = Annotated[float, Meta(ge=0, lt=MAX_COUNT)]
"""Below 2**53, not up to it: an integer past it (2**53 + 1) rounds to 2**53 as a float and would pass `le`."""
Timestamp = Annotated[float, Meta(ge=0, le=MAX_TIME, description="unix seconds")]
Text = Annotated[str, text(MAX_TEXT)]
Host = Annotated[str, text(MAX_HOST)]
Node = Annotated[str, text(MAX_NODE, min_length=1, description="a node sidecar's name (host:port)")]
RunId = Annotated[str, text(MAX_RUN_ID, min_length=1)]
"""A run a sidecar takes summaries of is one it can watch: an activity report's run id has the same bound."""
Error = Annotated[str, text(MAX_ERROR_CHARS, description="crashed: 'ExceptionType: message'")]
Order = Annotated[
    str,
    Meta(
        pattern="^(" + "|".join(ORDERS) + ")" + PYTHON_END,
        description="the run's rank order, fastest dimension first (parwatch.rank_layout); absent: tp-pp-dp",
    ),
]
WireFloat = float | str | None
"""A loss as the wire carries it: a number, null, or one of the strings "nan", "inf", "-inf" (a record's
`loss` property reads it as a float or None)."""
NONFINITE = ("nan", "inf", "-inf")


def decode_float(x: object) -> float | None:
    """A number as the wire carries it (parwatch.vocabulary.jsonable writes NaN/inf as strings)."""
    if x is None:
        return None
    if isinstance(x, str):
        if x in NONFINITE:
            return float(x)
        raise ValueError(f"not a number: {x!r} (expected a number, 'nan', 'inf' or '-inf')")
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"not a number: {x!r}")
    return float(x)


def check_number(value: WireFloat, name: str) -> None:
    """A ValueError naming the field unless `value` is a WireFloat (msgspec adds the record's path)."""
    if isinstance(value, int) and abs(value) > MAX_COUNT:
        raise ValueError(f"{name}: {str(value)[:20]}... is too large; send it as a float (or 'inf')")
    try:
        decode_float(value)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
