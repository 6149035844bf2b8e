"""Synthetic compute: each chunk's layer math replaced by a sleep of fixed length.

The schedule, the point-to-point transfers and the TP all-reduces (2 forward
and 2 backward per layer, of b*s*h elements) all still happen; only the
arithmetic is replaced, and the sleep runs to a deadline that includes the
TP collectives, so a chunk's forward takes exactly fwd_ms whatever the
machine's load. Timing checks of the bubble are then exact on a busy machine.
With serial_tp the sleep follows the TP collectives instead, as real TP layers'
compute does: a rank that waits for a late TP peer then computes no less for it
(the fault campaign's straggler and slow-link trials need that).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from parwatch.trainer.comm import Comm
from parwatch.vocabulary import GroupRole


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


def _tp_traffic(comm: Comm, layers: int, like: torch.Tensor) -> None:
    for _ in range(2 * layers):
        comm.all_reduce(torch.zeros_like(like), GroupRole.TP)


class _TimedIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, chunk):
        deadline = time.perf_counter() + chunk.fwd_s
        _tp_traffic(chunk.comm, chunk.layers, x)
        if chunk.serial_tp:
            deadline = time.perf_counter() + chunk.fwd_s
        ctx.chunk = chunk
        ctx.save_for_backward(x, weight)
        _sleep_until(deadline)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        chunk = ctx.chunk
        deadline = time.perf_counter() + chunk.bwd_s
        x, weight = ctx.saved_tensors
        _tp_traffic(chunk.comm, chunk.layers, grad)
        if chunk.serial_tp:
            deadline = time.perf_counter() + chunk.bwd_s
        _sleep_until(deadline)
        return grad * weight, (grad * x).sum().reshape(weight.shape), None


class SyntheticChunk(nn.Module):
    """Stands in for a Chunk: same inputs and outputs, timed sleeps instead of math."""

    def __init__(
        self,
        layers: int,
        hidden: int,
        vocab: int,
        comm: Comm,
        fwd_s: float,
        bwd_s: float,
        first: bool,
        dtype: torch.dtype,
        serial_tp: bool = False,
    ):
        super().__init__()
        self.serial_tp = serial_tp
        self.layers, self.hidden, self.vocab, self.comm = layers, hidden, vocab, comm
        self.fwd_s, self.bwd_s = fwd_s, bwd_s
        self.first = first
        self.weight = nn.Parameter(torch.ones(1, dtype=dtype))
        self.dtype = dtype

    def forward(self, x):
        if self.first:
            x = (x.to(self.dtype) / self.vocab).unsqueeze(-1).expand(*x.shape, self.hidden).contiguous()
        return _TimedIdentity.apply(x, self.weight, self)

    def loss(self, output, targets):
        return output.pow(2).mean()
