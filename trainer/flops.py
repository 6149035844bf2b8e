"""Model FLOPs one rank performs per optimizer step, for model FLOPs utilisation (MFU).

The usual estimate (PaLM, appendix B; Megatron's MFU): per token, a training step costs
6 FLOPs per matmul parameter (2 forward, 4 backward) plus 12 * layers * h * s for
attention scores and their application. Per rank: the matmul parameters this rank holds
(its TP slice of its stage's layers) and its DP replica's tokens, with attention counted for
its layers over its h/tp heads' width. Embedding lookups and element-wise work are left out,
as in the published formula, so MFU is comparable with other tools' numbers.
"""

from __future__ import annotations

from torch import nn

from parwatch.trainer.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def matmul_params(chunks: list[nn.Module]) -> int:
    """Weights of this rank's column- and row-parallel linears (its TP slice)."""
    return sum(
        m.weight.numel()
        for c in chunks
        for m in c.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    )


def model_flops_per_step(
    chunks: list[nn.Module], layers_local: int, hidden: int, tp: int, seq_len: int, tokens_per_replica: int
) -> int:
    per_token = 6 * matmul_params(chunks) + 12 * layers_local * (hidden // tp) * seq_len
    return per_token * tokens_per_replica
