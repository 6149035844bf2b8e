"""Megatron-style tensor parallelism: the two conjugate mappings and the layers.

copy_to_tp:     forward identity,   backward all-reduce   (input of a column-parallel layer)
reduce_from_tp: forward all-reduce, backward identity     (output of a row-parallel layer)

A column-parallel linear splits the output features across TP ranks, a
row-parallel one the input features; a column layer feeding a row layer needs
no communication in between (the MLP, attention heads). Per transformer layer
that is 2 all-reduces forward and 2 backward, each of b*s*h elements.

Weights are initialised as the full matrix from a generator seeded by the
parameter's name and then sliced, so every TP degree holds a slice of the same
model a single process would build.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from parwatch.trainer.comm import Comm
from parwatch.vocabulary import GroupRole


# ------------------------------------------------------------------ mappings
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad.contiguous(), GroupRole.TP), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x.contiguous(), GroupRole.TP)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _CopyToTP.apply(x, comm) if comm.size(GroupRole.TP) > 1 else x


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _ReduceFromTP.apply(x, comm) if comm.size(GroupRole.TP) > 1 else x


# -------------------------------------------------------------- initialisation
def full_init(name: str, shape: tuple, seed: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    """The full (unsharded) tensor for parameter `name`: identical on every rank and layout."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:7], "little"))
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(dtype)


def _shard(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return full.chunk(size, dim=dim)[rank].clone()


# -------------------------------------------------------------------- layers
class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across TP ranks; output stays split."""

    def __init__(self, name, in_features, out_features, comm: Comm, seed, dtype, bias=True, std=0.02):
        super().__init__()
        tp, rank = comm.size(GroupRole.TP), comm.groups.coords.tp_rank
        if out_features % tp:
            raise ValueError(f"{name}: out_features={out_features} is not divisible by tp={tp}")
        self.comm = comm
        full = full_init(f"{name}.weight", (out_features, in_features), seed, std, dtype)
        self.weight = nn.Parameter(_shard(full, 0, rank, tp))
        self.bias = nn.Parameter(torch.zeros(out_features // tp, dtype=dtype)) if bias else None

    def forward(self, x):
        return F.linear(copy_to_tp(x, self.comm), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split; the partial sums are all-reduced."""

    def __init__(self, name, in_features, out_features, comm: Comm, seed, dtype, bias=True, std=0.02):
        super().__init__()
        tp, rank = comm.size(GroupRole.TP), comm.groups.coords.tp_rank
        if in_features % tp:
            raise ValueError(f"{name}: in_features={in_features} is not divisible by tp={tp}")
        self.comm = comm
        full = full_init(f"{name}.weight", (out_features, in_features), seed, std, dtype)
        self.weight = nn.Parameter(_shard(full, 1, rank, tp))
        # The bias is added once, after the reduction, so it is replicated, not split.
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; lookups outside the range give 0, then all-reduce."""

    def __init__(self, name, vocab, hidden, comm: Comm, seed, dtype, std=0.02):
        super().__init__()
        tp, rank = comm.size(GroupRole.TP), comm.groups.coords.tp_rank
        if vocab % tp:
            raise ValueError(f"vocab={vocab} is not divisible by tp={tp}; choose a vocab that is a multiple of {tp}")
        self.comm = comm
        self.per_rank = vocab // tp
        self.start = rank * self.per_rank
        full = full_init(f"{name}.weight", (vocab, hidden), seed, std, dtype)
        self.weight = nn.Parameter(_shard(full, 0, rank, tp))

    def forward(self, ids):
        if self.comm.size(GroupRole.TP) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.comm)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits split by vocabulary: 3 small all-reduces (max, target logit, sum exp)."""

    @staticmethod
    def forward(ctx, logits, target, comm, vocab_start):
        logits = logits.float() if logits.dtype == torch.float16 else logits
        local_max = logits.max(dim=-1).values
        comm.all_reduce(local_max, GroupRole.TP, op="max")
        shifted = logits - local_max.unsqueeze(-1)
        n_local = logits.shape[-1]
        local_t = target - vocab_start
        outside = (local_t < 0) | (local_t >= n_local)
        picked = shifted.gather(-1, local_t.masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(outside, 0.0)
        comm.all_reduce(picked, GroupRole.TP)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, GroupRole.TP)
        loss = sum_exp.log() - picked
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax.clone()
        onehot = torch.zeros_like(grad).scatter_(-1, local_t.masked_fill(outside, 0).unsqueeze(-1), 1.0)
        grad -= onehot * (~outside).unsqueeze(-1).to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits, target, comm: Comm) -> torch.Tensor:
    """Per-token loss (no reduction) for logits split by vocabulary across TP ranks."""
    vocab_start = comm.groups.coords.tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, comm, vocab_start)
