"""A small GPT, tensor-parallel inside each layer, cut into pipeline chunks.

The model is a list of pieces: embedding, n transformer blocks, head. A
pipeline chunk is a consecutive run of pieces (parwatch.trainer.partition decides
which). Every piece is built from full, name-seeded weights, so any TP x PP
layout holds exactly the parameters of the single-process model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from parwatch.trainer.comm import Comm
from parwatch.trainer.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_init,
    vocab_parallel_cross_entropy,
)
from parwatch.vocabulary import GroupRole


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 4
    """Transformer blocks."""
    hidden: int = 64
    """Model width h."""
    heads: int = 4
    """Attention heads; split across TP ranks, so divisible by tp."""
    vocab: int = 64
    """Vocabulary size; split across TP ranks, so divisible by tp."""
    seq_len: int = 32
    """Tokens per sequence."""
    seed: int = 0
    """Seeds the weights (by parameter name) and the data."""
    dtype: torch.dtype = torch.float32


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig, comm: Comm):
        super().__init__()
        self.tok = VocabParallelEmbedding("embed.tok", cfg.vocab, cfg.hidden, comm, cfg.seed, cfg.dtype)
        self.pos = nn.Parameter(full_init("embed.pos", (cfg.seq_len, cfg.hidden), cfg.seed, 0.02, cfg.dtype))

    def forward(self, ids):
        return self.tok(ids) + self.pos[: ids.shape[1]]


class Block(nn.Module):
    """Pre-LN transformer block; heads and MLP columns split across TP ranks."""

    def __init__(self, index: int, cfg: GPTConfig, comm: Comm):
        super().__init__()
        tp = comm.size(GroupRole.TP)
        h, name = cfg.hidden, f"block{index}"
        self.heads_local = cfg.heads // tp
        self.head_dim = h // cfg.heads
        self.ln1 = nn.LayerNorm(h, dtype=cfg.dtype)
        self.ln2 = nn.LayerNorm(h, dtype=cfg.dtype)
        # QKV rows are laid out head by head ([heads, 3, head_dim]), so a contiguous
        # slice of rows holds whole heads' q, k and v: one column-parallel matmul.
        self.qkv = ColumnParallelLinear(f"{name}.qkv", h, 3 * h, comm, cfg.seed, cfg.dtype)
        proj_std = 0.02 / math.sqrt(2 * cfg.layers)
        self.proj = RowParallelLinear(f"{name}.proj", h, h, comm, cfg.seed, cfg.dtype, std=proj_std)
        self.fc1 = ColumnParallelLinear(f"{name}.fc1", h, 4 * h, comm, cfg.seed, cfg.dtype)
        self.fc2 = RowParallelLinear(f"{name}.fc2", 4 * h, h, comm, cfg.seed, cfg.dtype, std=proj_std)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, self.heads_local, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and a column-parallel LM head; the loss is vocab-parallel."""

    def __init__(self, cfg: GPTConfig, comm: Comm):
        super().__init__()
        self.comm = comm
        self.ln = nn.LayerNorm(cfg.hidden, dtype=cfg.dtype)
        self.lm = ColumnParallelLinear("head.lm", cfg.hidden, cfg.vocab, comm, cfg.seed, cfg.dtype, bias=False)

    def forward(self, x):
        return self.lm(self.ln(x))

    def loss(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, self.comm).mean()


def build_pieces(cfg: GPTConfig, comm: Comm, indices: range) -> list[nn.Module]:
    """Pieces `indices` of [embedding, block 0..n-1, head] (n + 2 pieces in all)."""
    pieces: list[nn.Module] = []
    for i in indices:
        if i == 0:
            pieces.append(Embedding(cfg, comm))
        elif i == cfg.layers + 1:
            pieces.append(Head(cfg, comm))
        else:
            pieces.append(Block(i - 1, cfg, comm))
    return pieces


class Chunk(nn.Module):
    """One pipeline chunk: consecutive pieces. The last chunk also computes the loss."""

    def __init__(self, pieces: list[nn.Module]):
        super().__init__()
        self.pieces = nn.ModuleList(pieces)

    def forward(self, x):
        for piece in self.pieces:
            x = piece(x)
        return x

    def loss(self, output, targets):
        return self.pieces[-1].loss(output, targets)  # type: ignore[operator]  # nn.Module attributes read as Tensor
