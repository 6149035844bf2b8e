"""Tensor-parallel layers on 2 gloo ranks against the unsharded nn.functional computation.

Every layer is built sharded from the same full_init weights a single process would
use; outputs and input/weight gradients must match the full computation (sliced to
this rank's shard where the layer keeps it split): fp64 to 1e-12, fp32 to 1e-6.
One spawn computes every comparison for both dtypes; the tests read its errors.
"""

import pytest

from tests.distutil import run_ranks

pytestmark = [pytest.mark.beside_serial, pytest.mark.dist, pytest.mark.timeout(200)]

TOLERANCE = {"float64": 1e-12, "float32": 1e-6}
B, S, H, VOCAB = 2, 5, 8, 16


def _err(got, want) -> tuple[float, float]:
    """(largest difference, relative to the reference's scale when that exceeds 1; that scale)."""
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / max(1.0, scale), scale


def _compare_layers(rank: int, world_size: int) -> dict:
    import torch
    import torch.nn.functional as F

    from parwatch.trainer.comm import Comm
    from parwatch.trainer.parallel_dims import ParallelDims, build_groups
    from parwatch.trainer.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        full_init,
        vocab_parallel_cross_entropy,
    )

    comm = Comm(build_groups(ParallelDims(tp=2, pp=1, dp=1, world_size=world_size), rank))
    tp = world_size
    errors = {}

    def shard(t, dim):
        return t.chunk(tp, dim=dim)[rank]

    for dtype_name, dtype in (("float64", torch.float64), ("float32", torch.float32)):
        gen = torch.Generator().manual_seed(1234)  # identical inputs on both ranks

        def rand(*shape, gen=gen, dtype=dtype):  # bound now: called only within this iteration
            return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

        def record(layer, dtype_name=dtype_name, **pairs):
            for what, (got, want) in pairs.items():
                errors[(layer, dtype_name, what)] = _err(got, want)

        # Column-parallel: output split by columns; x's gradient is all-reduced in backward.
        col = ColumnParallelLinear("t.col", H, 4 * H, comm, seed=3, dtype=dtype)
        b_full = rand(4 * H).requires_grad_()  # a non-zero bias, so its path is checked too
        with torch.no_grad():
            col.bias.copy_(shard(b_full, 0))
        w_full = full_init("t.col.weight", (4 * H, H), 3, 0.02, dtype).requires_grad_()
        x = rand(B, S, H)
        upstream = rand(B, S, 4 * H)
        x_tp, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = col(x_tp)
        (out * shard(upstream, -1)).sum().backward()
        ref = F.linear(x_ref, w_full, b_full)
        (ref * upstream).sum().backward()
        record(
            "column",
            output=(out, shard(ref, -1)),
            input_grad=(x_tp.grad, x_ref.grad),
            weight_grad=(col.weight.grad, shard(w_full.grad, 0)),
            bias_grad=(col.bias.grad, shard(b_full.grad, 0)),
        )

        # Row-parallel: input split by columns; partial outputs all-reduced in forward.
        row = RowParallelLinear("t.row", 4 * H, H, comm, seed=3, dtype=dtype)
        with torch.no_grad():
            row.bias.copy_(rand(H))
        w_full = full_init("t.row.weight", (H, 4 * H), 3, 0.02, dtype).requires_grad_()
        b_full = row.bias.detach().clone().requires_grad_()
        x = rand(B, S, 4 * H)
        upstream = rand(B, S, H)
        x_tp, x_ref = shard(x, -1).clone().requires_grad_(), x.clone().requires_grad_()
        out = row(x_tp)
        (out * upstream).sum().backward()
        ref = F.linear(x_ref, w_full, b_full)
        (ref * upstream).sum().backward()
        record(
            "row",
            output=(out, ref),
            input_grad=(x_tp.grad, shard(x_ref.grad, -1)),
            weight_grad=(row.weight.grad, shard(w_full.grad, 1)),
            bias_grad=(row.bias.grad, b_full.grad),
        )

        # Vocab-parallel embedding: ids from the whole vocabulary, so both ranks' ranges are hit.
        emb = VocabParallelEmbedding("t.emb", VOCAB, H, comm, seed=3, dtype=dtype)
        w_full = full_init("t.emb.weight", (VOCAB, H), 3, 0.02, dtype).requires_grad_()
        ids = torch.randint(0, VOCAB, (B, S), generator=gen)
        upstream = rand(B, S, H)
        out = emb(ids)
        (out * upstream).sum().backward()
        ref = F.embedding(ids, w_full)
        (ref * upstream).sum().backward()
        record("embedding", output=(out, ref), weight_grad=(emb.weight.grad, shard(w_full.grad, 0)))

        # Vocab-parallel cross entropy: per-token loss and the gradient of this rank's logits.
        logits = rand(B, S, VOCAB) * 3
        targets = torch.randint(0, VOCAB, (B, S), generator=gen)
        upstream = rand(B, S)
        local = shard(logits, -1).clone().requires_grad_()
        full = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, comm)
        (loss * upstream).sum().backward()
        ref = F.cross_entropy(full.view(-1, VOCAB), targets.view(-1), reduction="none").view(B, S)
        (ref * upstream).sum().backward()
        record("cross_entropy", loss=(loss, ref), logits_grad=(local.grad, shard(full.grad, -1)))
        errors[("cross_entropy", dtype_name, "loss_dtype")] = str(loss.dtype).removeprefix("torch.")
    return errors


@pytest.fixture(scope="module")
def errors_by_rank():
    return run_ranks(_compare_layers, 2, timeout=180)


CASES = (
    [("column", q) for q in ("output", "input_grad", "weight_grad", "bias_grad")]
    + [("row", q) for q in ("output", "input_grad", "weight_grad", "bias_grad")]
    + [
        ("embedding", "output"),
        ("embedding", "weight_grad"),
        ("cross_entropy", "loss"),
        ("cross_entropy", "logits_grad"),
    ]
)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("layer,quantity", CASES)
def test_tp_layer_matches_single_process(errors_by_rank, layer, quantity, dtype):
    for rank, errors in enumerate(errors_by_rank):
        err, scale = errors[(layer, dtype, quantity)]
        assert scale > 0, f"rank {rank}: {layer} {quantity} is all zeros: the comparison would prove nothing"
        assert err <= TOLERANCE[dtype], f"rank {rank}: {layer} {quantity} ({dtype}) differs by {err:.3e}"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cross_entropy_keeps_the_logits_dtype(errors_by_rank, dtype):
    assert all(e[("cross_entropy", dtype, "loss_dtype")] == dtype for e in errors_by_rank)
