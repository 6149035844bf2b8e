"""Deterministic synthetic data on a learnable task.

Every sequence walks a fixed random permutation of the vocabulary from a
random first token: token i+1 = perm[token i]. The permutation is a function
of the seed, so the model can learn it (embedding -> MLP -> head does), and
the loss visibly falls from ln(vocab) towards 0 within a few dozen steps.

A microbatch is a pure function of (seed, data_step, index): no state, so a
rollback replays the same batches and a skip moves past them. Data-parallel
replica d takes microbatches d*m .. d*m+m-1 of the global batch, so a run with
dp=2, m=2 sees the same samples as dp=1, m=4.
"""

from __future__ import annotations

import functools
import hashlib

import torch


def _generator(seed: int, data_step: int, index: int) -> torch.Generator:
    digest = hashlib.sha256(f"parwatch-data:{seed}:{data_step}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:7], "little"))


@functools.lru_cache(maxsize=8)
def _permutation(seed: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + 17)
    return torch.randperm(vocab, generator=gen)


def microbatch(seed: int, data_step: int, index: int, batch: int, seq_len: int, vocab: int):
    """(inputs, targets), each [batch, seq_len] int64, for global microbatch `index`."""
    perm = _permutation(seed, vocab)
    gen = _generator(seed, data_step, index)
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for i in range(seq_len):
        tokens[:, i + 1] = perm[tokens[:, i]]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def global_index(dp_rank: int, microbatches: int, local_index: int) -> int:
    return dp_rank * microbatches + local_index
