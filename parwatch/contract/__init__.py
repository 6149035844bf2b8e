"""parwatch's instrumentation contract: what any trainer emits, and nothing else.

Dependency-free (standard library only), so a trainer can import it without
pulling in parwatch's collector, the sidecar or torch:

    from parwatch.contract import SpanKind, registry

    with registry.span(SpanKind.FORWARD, stage=0, microbatch=3, chunk=0):
        out = stage_module(x)

- `spans`: span kinds and events as enums, the Clock and Observer protocols, the
  process-wide hook registry.
- `directives`: pause / resume / rollback, and the outcome every rank reports back.
- `boundary`: the step boundary, one small SUM all-reduce per step whose width does
  not depend on the world size, and `StepBoundary`, the driver that runs it.
- `step_check`: the check before the optimizer step: one small all-reduce of every rank's loss and
  gradient finiteness, and what every rank then does with a bad step (re-run, skip, pause).
- `torch_all_reduce`: that all-reduce over torch.distributed (torch imported only when used);
  `torch_grads`: a rank's gradient reading for the check (torch imported only when used).

The reference trainer (`parwatch/trainer/`) and the torch.distributed.pipelining integration
(`parwatch.integrations`) both drive this module; the collector observes it.
"""

from parwatch.contract.boundary import (
    HEADER_SLOTS,
    BoundaryInfo,
    OutcomeReport,
    StepBoundary,
    Unresumable,
    new_run_id,
    run_key,
)
from parwatch.contract.directives import Action, Directive, FailReason, Outcome
from parwatch.contract.spans import (
    COMPUTE_KINDS,
    OTHER_KINDS,
    BoundaryKind,
    Clock,
    Event,
    HookRegistry,
    Observer,
    PerfCounterClock,
    Span,
    SpanKind,
    registry,
)
from parwatch.contract.step_check import StepCheck, StepPolicy, StepReading, Verdict
from parwatch.contract.torch_all_reduce import TorchAllReduce

__all__ = [
    "Action",
    "BoundaryInfo",
    "BoundaryKind",
    "COMPUTE_KINDS",
    "Clock",
    "Directive",
    "Event",
    "FailReason",
    "HEADER_SLOTS",
    "HookRegistry",
    "OTHER_KINDS",
    "Observer",
    "Outcome",
    "OutcomeReport",
    "PerfCounterClock",
    "Span",
    "SpanKind",
    "StepBoundary",
    "StepCheck",
    "StepPolicy",
    "StepReading",
    "TorchAllReduce",
    "Unresumable",
    "Verdict",
    "registry",
    "new_run_id",
    "run_key",
]
