"""Synthetic data: a pure function of (seed, data step, global index), on a learnable task."""

import pytest
import torch

from parwatch.trainer.data import global_index, microbatch

ARGS = dict(batch=3, seq_len=12, vocab=64)


def _mb(seed=0, step=1, index=0, **kw):
    return microbatch(seed, step, index, **{**ARGS, **kw})


def test_same_seed_step_and_index_give_the_same_tensors():
    a_in, a_t = _mb(seed=5, step=7, index=2)
    b_in, b_t = _mb(seed=5, step=7, index=2)
    assert torch.equal(a_in, b_in) and torch.equal(a_t, b_t)


@pytest.mark.parametrize("other", [dict(index=1), dict(step=2), dict(seed=1)])
def test_a_different_index_step_or_seed_gives_different_tokens(other):
    base, _ = _mb()
    changed, _ = _mb(**other)
    assert not torch.equal(base, changed)


def test_shapes_dtype_and_range():
    inputs, targets = _mb()
    assert inputs.shape == targets.shape == (3, 12)
    assert inputs.dtype == targets.dtype == torch.int64
    assert int(inputs.min()) >= 0 and int(inputs.max()) < 64
    assert inputs.is_contiguous() and targets.is_contiguous()


def test_targets_are_the_inputs_shifted_by_one():
    inputs, targets = _mb()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_next_token_is_a_fixed_permutation_of_the_current_one():
    # The task is learnable: one map token -> next token, shared by every sequence and step.
    mapping = {}
    for step in range(1, 4):
        for index in range(4):
            inputs, targets = _mb(step=step, index=index)
            for x, y in zip(inputs.flatten().tolist(), targets.flatten().tolist()):
                assert mapping.setdefault(x, y) == y
    assert len(set(mapping.values())) == len(mapping)  # injective: a permutation


def test_data_does_not_depend_on_global_rng_state():
    torch.manual_seed(1)
    a, _ = _mb()
    torch.manual_seed(2)
    torch.rand(10)
    b, _ = _mb()
    assert torch.equal(a, b)


def test_dp_replicas_take_consecutive_slices_of_the_global_batch():
    assert [global_index(d, 2, i) for d in range(2) for i in range(2)] == [0, 1, 2, 3]
    assert [global_index(d, 3, i) for d in range(3) for i in range(3)] == list(range(9))


def test_dp2_m2_sees_the_same_samples_as_dp1_m4():
    single = [_mb(step=3, index=global_index(0, 4, i)) for i in range(4)]
    replicas = [_mb(step=3, index=global_index(d, 2, i)) for d in range(2) for i in range(2)]
    for (a_in, a_t), (b_in, b_t) in zip(single, replicas):
        assert torch.equal(a_in, b_in) and torch.equal(a_t, b_t)
