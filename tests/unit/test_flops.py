"""The model-FLOPs estimate behind MFU: 6 per matmul parameter per token, plus attention."""

from __future__ import annotations

import torch

from parwatch.trainer.comm import Comm
from parwatch.trainer.flops import matmul_params, model_flops_per_step
from parwatch.trainer.model import Chunk, GPTConfig, build_pieces
from parwatch.trainer.parallel_dims import ParallelDims, ProcessGroups


def _single_rank_comm() -> Comm:
    dims = ParallelDims(1, 1, 1, 1)
    return Comm(ProcessGroups(dims=dims, coords=dims.coords(0)))


def test_matmul_params_are_the_linear_weights_of_blocks_and_head():
    cfg = GPTConfig(layers=3, hidden=32, heads=4, vocab=64, seq_len=16, dtype=torch.float32)
    chunk = Chunk(build_pieces(cfg, _single_rank_comm(), range(0, cfg.layers + 2)))
    h, v = cfg.hidden, cfg.vocab
    assert matmul_params([chunk]) == cfg.layers * 12 * h * h + h * v  # qkv 3h^2, proj h^2, fc1 4h^2, fc2 4h^2


def test_flops_per_step_follow_the_published_formula():
    cfg = GPTConfig(layers=2, hidden=32, heads=4, vocab=64, seq_len=16, dtype=torch.float32)
    chunk = Chunk(build_pieces(cfg, _single_rank_comm(), range(0, cfg.layers + 2)))
    tokens = 4 * 2 * cfg.seq_len
    n = matmul_params([chunk])
    expected = (6 * n + 12 * cfg.layers * cfg.hidden * cfg.seq_len) * tokens
    assert model_flops_per_step([chunk], cfg.layers, cfg.hidden, 1, cfg.seq_len, tokens) == expected
