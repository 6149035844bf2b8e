"""`parwatch.integrations.shared_run_id`: rank 0's new id on every rank, on real gloo ranks."""

from __future__ import annotations

import pytest

from tests.distutil import run_ranks

pytestmark = [pytest.mark.beside_serial, pytest.mark.dist, pytest.mark.timeout(120)]


def ids_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from parwatch.integrations import shared_run_id

    out = {"world": [shared_run_id(), shared_run_id()]}
    tail = dist.new_group([1, 2])  # every rank creates it; its first rank is global rank 1
    if rank in (1, 2):
        out["tail"] = shared_run_id(tail)
    return out


def test_every_rank_gets_rank_0s_new_id_and_a_group_its_first_ranks():
    out = run_ranks(ids_body, 3, timeout=100)
    first, second = out[0]["world"]
    assert all(r["world"] == [first, second] for r in out)
    assert first != second  # a new id per call
    assert out[1]["tail"] == out[2]["tail"] and out[1]["tail"] not in (first, second)
    assert "tail" not in out[0]
    assert len(first.split("-")) == 3 and len(first.split("-")[2]) == 6
