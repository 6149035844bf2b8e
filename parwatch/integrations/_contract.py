"""The contract names the integrations use (span kinds, events, the registry, the boundary).

TRANSITIONAL: parwatch/contract (enums, hook registry, StepBoundary) is being built on main.
Until this branch has it, the same names come from the bundled trainer's hooks module and a
small adapter (`_legacy_boundary`) that speaks today's boundary protocol with the contract's
StepBoundary methods; kinds the old collector does not know (backward_input, backward_weight,
loss) are handed to it as compute kinds with a `part` attribute. Delete the fallback, this
file's second half and `_legacy_boundary` once the contract is merged.
"""

from __future__ import annotations

import importlib.util
import os

import parwatch


def _contract_here() -> bool:
    # An editable install may resolve `parwatch.contract` from another checkout: use it only
    # when it is this package's own module.
    spec = importlib.util.find_spec("parwatch.contract")
    here = os.path.dirname(os.path.abspath(parwatch.__file__))
    return spec is not None and spec.origin is not None and os.path.abspath(spec.origin).startswith(here + os.sep)


LEGACY = not _contract_here()

if not LEGACY:
    from parwatch.contract import (  # noqa: F401
        Action,
        BoundaryKind,
        Event,
        FailReason,
        Outcome,
        SpanKind,
        StepBoundary,
        registry,
    )
else:  # pragma: no cover - until the contract lands on this branch
    from parwatch.integrations._legacy_boundary import (  # noqa: F401
        Action,
        BoundaryKind,
        Event,
        FailReason,
        Outcome,
        SpanKind,
        StepBoundary,
        registry,
    )

_LEGACY_KINDS = {"backward_input": ("backward", "input"), "backward_weight": ("backward", "weight"),
                 "loss": ("forward", "loss")}


def wire_kind(kind, attrs: dict):
    """The kind to hand the registry: the contract's enum (before it lands: a kind the old collector counts)."""
    if not LEGACY:
        return kind
    mapped = _LEGACY_KINDS.get(kind.value)
    if mapped is None:
        return kind.value
    attrs["part"] = mapped[1]
    return mapped[0]
