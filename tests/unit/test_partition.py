"""Cutting [embedding, blocks, head] into pipeline chunks: uniform and parameter-balanced."""

import itertools

import pytest

from parwatch.trainer.errors import ConfigError
from parwatch.trainer.partition import block_param_count, partition, piece_param_counts


def _blocks(ranges, layers):
    return [sum(1 for i in r if 1 <= i <= layers) for r in ranges]


def _loads(ranges, counts):
    return [sum(counts[i] for i in r) for r in ranges]


@pytest.mark.parametrize("layers,parts", [(4, 1), (4, 2), (4, 4), (10, 4), (7, 3), (12, 8)])
@pytest.mark.parametrize("method", ["uniform", "parameters"])
def test_chunks_cover_every_piece_once_in_order(layers, parts, method):
    counts = piece_param_counts(layers, 32, 64, 16)
    ranges = partition(layers, parts, method, counts)
    assert len(ranges) == parts
    assert list(itertools.chain.from_iterable(ranges)) == list(range(layers + 2))
    assert 0 in ranges[0] and layers + 1 in ranges[-1]  # embedding first, head last
    assert min(_blocks(ranges, layers)) >= 1  # every chunk holds at least one block


def test_uniform_gives_equal_blocks_with_the_remainder_up_front():
    ranges = partition(10, 4, "uniform")
    assert _blocks(ranges, 10) == [3, 3, 2, 2]
    assert ranges == [range(0, 4), range(4, 7), range(7, 9), range(9, 12)]


def _best_max_load(counts, layers, parts):
    """Brute force: the smallest possible largest chunk over every way to cut the blocks."""
    best = None
    for cuts in itertools.combinations(range(1, layers), parts - 1):
        bounds = (0, *cuts, layers)
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        starts = [1 + sum(sizes[:k]) for k in range(parts)]
        ranges = [
            range(0 if k == 0 else s, s + n + (1 if k == parts - 1 else 0))
            for k, (s, n) in enumerate(zip(starts, sizes))
        ]
        load = max(_loads(ranges, counts))
        best = load if best is None else min(best, load)
    return best


@pytest.mark.parametrize("layers,parts,vocab", [(8, 2, 50_000), (8, 4, 50_000), (6, 3, 64), (9, 4, 8_000)])
def test_parameters_method_minimises_the_largest_chunk(layers, parts, vocab):
    counts = piece_param_counts(layers, 64, vocab, 32)
    ranges = partition(layers, parts, "parameters", counts)
    assert max(_loads(ranges, counts)) == _best_max_load(counts, layers, parts)


def test_a_big_embedding_and_head_take_fewer_blocks_with_them():
    layers, parts = 8, 4
    counts = piece_param_counts(layers, 64, 50_000, 32)  # embedding and head ~ 64 blocks each
    balanced = partition(layers, parts, "parameters", counts)
    uniform = partition(layers, parts, "uniform", counts)
    assert _blocks(uniform, layers) == [2, 2, 2, 2]
    blocks = _blocks(balanced, layers)
    assert blocks[0] == 1 and blocks[-1] == 1 and sum(blocks) == layers
    assert blocks[1] == blocks[2] == 3  # the middle chunks share the rest evenly
    assert max(_loads(balanced, counts)) < max(_loads(uniform, counts))


def test_equal_pieces_balance_like_uniform():
    counts = [0] + [block_param_count(32)] * 8 + [0]
    assert _blocks(partition(8, 4, "parameters", counts), 8) == [2, 2, 2, 2]


def test_fewer_layers_than_chunks_names_the_setting_and_fix():
    with pytest.raises(ConfigError) as err:
        partition(3, 4)
    message = str(err.value)
    assert "--layers=3" in message and "raise --layers to 4" in message and "pp*v in [1, 3]" in message


def test_unknown_method_and_missing_counts():
    with pytest.raises(ConfigError, match="--partition='even' is unknown; choose 'uniform' or 'parameters'"):
        partition(4, 2, "even")
    with pytest.raises(ValueError, match="needs the pieces' parameter counts"):
        partition(4, 2, "parameters")


def test_param_counts_match_the_real_model():
    from parwatch.trainer.comm import Comm
    from parwatch.trainer.model import GPTConfig, build_pieces
    from parwatch.trainer.parallel_dims import ParallelDims, ProcessGroups

    dims = ParallelDims(1, 1, 1, 1)
    comm = Comm(ProcessGroups(dims=dims, coords=dims.coords(0)))  # tp=1: no process group needed
    cfg = GPTConfig(layers=2, hidden=32, heads=4, vocab=64, seq_len=16)
    pieces = build_pieces(cfg, comm, range(cfg.layers + 2))
    real = [sum(p.numel() for p in piece.parameters()) for piece in pieces]
    assert real == piece_param_counts(cfg.layers, cfg.hidden, cfg.vocab, cfg.seq_len)
