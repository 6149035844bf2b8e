"""A rank's reading for the check before the optimizer step, from torch tensors.

torch is imported when it is called, so the contract stays free of dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from parwatch.contract.step_check import StepReading

if TYPE_CHECKING:
    import torch


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of `params` as the optimizer will read them: Megatron's `main_grad` buffer where a
    parameter has one (its DDP wrapper accumulates there), else `.grad`; parameters without one are left out."""
    out = []
    for p in params:
        grad = getattr(p, "main_grad", None)
        if grad is None:
            grad = p.grad
        if grad is not None:
            out.append(grad)
    return out


def reading(loss: float | None, grads: list[torch.Tensor]) -> StepReading:
    """This rank's loss and whether its gradients are finite: one norm over them (torch's get_total_norm,
    foreach kernels where the device has them) and one host read; a NaN or an infinity anywhere makes it
    non-finite. (The trainers' own norms, their clipping's, are computed inside their optimizer step:
    too late for a check that decides whether that step runs.)"""
    if not grads:
        return StepReading(loss=loss, grads_finite=True, grad_sq=None)
    import torch

    norm = float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))
    return StepReading(loss=loss, grads_finite=math.isfinite(norm), grad_sq=norm * norm)
