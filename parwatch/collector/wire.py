"""The wire objects the collector produces and consumes (parwatch/schema.py): the step
summary it sends, and the sidecar's directive it receives."""

from __future__ import annotations

from collections import deque

from parwatch.collector.context import RunContext
from parwatch.collector.stats import StepBreakdown
from parwatch.schema import DIRECTIVE_ACTIONS, SCHEMA_VERSION, encode_float
from trainer.boundary import Directive


def build_summary(
    ctx: RunContext,
    *,
    step: int,
    time: float,
    result: StepBreakdown,
    loss: float | None,
    collectives: list,
    memory_max_allocated_bytes: int | None,
    gpu: dict | None,
    nvml_up: bool,
    dropped_total: int,
    checkpoints: list,
    applied: list,
    paused: bool,
    global_view: dict | None,
    overhead_seconds: float = 0.0,
) -> dict:
    """One StepSummary, keys in the schema's order. `global` is None except on rank 0."""
    return {
        "v": SCHEMA_VERSION,
        "run_id": ctx.run_id,
        "rank": ctx.rank,
        "stage": ctx.stage,
        "tp_rank": ctx.tp_rank,
        "dp_rank": ctx.dp_rank,
        "tp": ctx.tp,
        "pp": ctx.pp,
        "dp": ctx.dp,
        "microbatches": ctx.microbatches,
        "chunks": ctx.chunks,
        "schedule": ctx.schedule,
        "step": step,
        "time": time,
        "step_seconds": result.step_seconds,
        "compute_seconds": result.compute_seconds,
        "other_seconds": result.other_seconds,
        "idle_seconds": result.idle_seconds,
        "bubble_ratio": result.bubble_ratio,
        "bubble_theoretical_ratio": ctx.bubble_theoretical_ratio,
        "loss": None if loss is None else encode_float(float(loss)),
        "tokens": ctx.tokens_per_step,
        "memory_max_allocated_bytes": memory_max_allocated_bytes,
        "collectives": collectives,
        "gpu": gpu,
        "nvml_up": 1 if nvml_up else 0,
        "overhead_seconds": overhead_seconds,
        "dropped_total": dropped_total,
        "checkpoints": checkpoints,
        "applied": applied,
        "paused": paused,
        "global": global_view,
    }


def parse_directive(raw: dict) -> Directive:
    """The sidecar's directive dict as a trainer Directive; ValueError names the bad field."""
    if not isinstance(raw, dict):
        raise ValueError(f"directive must be an object, got {type(raw).__name__}")
    did, action = raw.get("id"), raw.get("action")
    to_step, skip = raw.get("to_step"), raw.get("skip_batches", 0)
    if not _is_int(did) or did <= 0:
        raise ValueError(f"directive id={did!r} must be an integer > 0")
    if action not in DIRECTIVE_ACTIONS:
        raise ValueError(f"directive action={action!r} must be one of {', '.join(DIRECTIVE_ACTIONS)}")
    if to_step is not None and (not _is_int(to_step) or to_step < 0):
        raise ValueError(f"directive to_step={to_step!r} must be null or an integer >= 0")
    if not _is_int(skip) or skip < 0:
        raise ValueError(f"directive skip_batches={skip!r} must be an integer >= 0")
    return Directive(id=did, action=action, to_step=to_step, skip_batches=skip, reason=str(raw.get("reason", "")))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class DirectiveInbox:
    """The sidecar's latest directive, written by the shipper thread and taken by the training thread.

    The sidecar repeats a directive in every reply until it sees it applied; `take()` hands
    each id over once. One attribute store per side: no lock is needed.
    """

    def __init__(self) -> None:
        self._latest: Directive | None = None
        self._taken: deque = deque(maxlen=256)  # ids already handed over (bounded)

    def put(self, raw: dict) -> None:
        """Shipper thread: validate and keep the reply's directive (ValueError if malformed)."""
        self._latest = parse_directive(raw)

    def take(self) -> Directive | None:
        directive = self._latest
        if directive is None or directive.id in self._taken:
            return None
        self._taken.append(directive.id)
        return directive
