"""Cut the model's pieces (embedding, blocks, head) into pipeline chunks.

Two methods, the two DeepSpeed offers: "uniform" gives every chunk the same
number of transformer blocks (embedding joins the first, head the last);
"parameters" balances parameter counts, so a large embedding or head takes
fewer blocks with it.
"""

from __future__ import annotations

from parwatch.trainer.errors import ConfigError


def block_param_count(hidden: int) -> int:
    h = hidden
    return 12 * h * h + 13 * h  # qkv 3h^2+3h, proj h^2+h, fc1 4h^2+4h, fc2 4h^2+h, 2 LayerNorms 4h


def piece_param_counts(layers: int, hidden: int, vocab: int, seq_len: int) -> list[int]:
    return [vocab * hidden + seq_len * hidden] + [block_param_count(hidden)] * layers + [hidden * vocab + 2 * hidden]


def partition(layers: int, parts: int, method: str = "uniform", counts: list[int] | None = None) -> list[range]:
    """Piece index ranges (over layers + 2 pieces) for each of `parts` chunks, in pipeline order."""
    if parts > layers:
        fits = [d for d in range(1, layers + 1) if layers % d == 0]
        raise ConfigError(
            f"{parts} pipeline chunks need at least {parts} layers, but --layers={layers}; "
            f"raise --layers to {parts} or more, or choose pp*v in {fits}"
        )
    if method == "uniform":
        base, extra = divmod(layers, parts)
        sizes = [base + (1 if i < extra else 0) for i in range(parts)]
    elif method == "parameters":
        if counts is None:
            raise ValueError("partition method 'parameters' needs the pieces' parameter counts")
        sizes = _balance(counts, layers, parts)
    else:
        raise ConfigError(f"--partition={method!r} is unknown; choose 'uniform' or 'parameters'")
    ranges, block = [], 1
    for i, size in enumerate(sizes):
        start = 0 if i == 0 else block
        end = block + size + (1 if i == parts - 1 else 0)
        ranges.append(range(start, end))
        block += size
    return ranges


def _balance(counts: list[int], layers: int, parts: int) -> list[int]:
    """Blocks per chunk minimising the largest chunk's parameters (every chunk >= 1 block).

    Linear-partition dynamic programme: best[k][i] = smallest possible largest load
    when the first i blocks form k chunks. O(parts * layers^2).
    """
    embed, blocks, head = counts[0], counts[1 : layers + 1], counts[-1]
    prefix = [0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def load(k: int, i: int, j: int) -> int:  # chunk k holds blocks i..j-1
        return prefix[j] - prefix[i] + (embed if k == 0 else 0) + (head if k == parts - 1 else 0)

    # Cost is (largest load, sum of squared loads): the second term spreads blocks
    # evenly when one huge piece (a large embedding) fixes the largest load anyway.
    inf = (float("inf"), float("inf"))
    best = [[inf] * (layers + 1) for _ in range(parts + 1)]
    cut = [[0] * (layers + 1) for _ in range(parts + 1)]
    best[0][0] = (0, 0)
    for k in range(1, parts + 1):
        for j in range(k, layers - (parts - k) + 1):
            for i in range(k - 1, j):
                chunk = load(k - 1, i, j)
                cost = (max(best[k - 1][i][0], chunk), best[k - 1][i][1] + chunk * chunk)
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    sizes, j = [], layers
    for k in range(parts, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]
