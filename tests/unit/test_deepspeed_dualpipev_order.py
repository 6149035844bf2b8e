"""DeepSpeed's DualPipeVSchedule as parwatch replays it (`dualpipev_schedule_order`), checked against
the schedule's own instruction stream: no ranks run (tests/dist/test_deepspeed.py runs them)."""

from __future__ import annotations

import pytest

from parwatch import pipeline_sim as ps
from parwatch.bubble import theoretical
from parwatch.integrations._deepspeed_order import dualpipev_schedule_order
from tests.distutil import installed

pytestmark = pytest.mark.skipif(not installed("deepspeed"), reason="pip install -e '.[test]' installs deepspeed")
SIZES = [(2, 4), (2, 5), (2, 8), (3, 6), (3, 7), (4, 8), (4, 13)]


@pytest.fixture(scope="module")
def ds():
    """deepspeed's schedule module, imported by the worker that runs these tests only (collection does not)."""
    from deepspeed.runtime.pipe import schedule

    if not hasattr(schedule, "DualPipeVSchedule"):
        pytest.skip("this deepspeed has no DualPipeVSchedule (0.19.8 has)")
    return schedule


def stream(ds, p: int, m: int, rank: int) -> list:
    return [cmd for cmds in ds.DualPipeVSchedule(micro_batches=m, stages=p, stage_id=rank).steps() for cmd in cmds]


@pytest.mark.parametrize("p, m", SIZES)
def test_the_order_is_the_streams_computes(ds, p, m):
    order = ps.normalize(dualpipev_schedule_order(p, m))
    for rank in range(p):
        computes = [cmd for cmd in stream(ds, p, m, rank) if type(cmd) in (ds.ForwardPass, ds.BackwardPass)]
        assert len(order[rank]) == len(computes) == 4 * m
        for action, cmd in zip(order[rank], computes):
            assert action.type == ("F" if type(cmd) is ds.ForwardPass else "B")
            assert action.stage == (rank if cmd.phase == 0 else 2 * p - 1 - rank)  # the V
            assert cmd.buffer_id == cmd.phase * m + action.microbatch
    every = sorted(str(a) for actions in order.values() for a in actions)
    assert every == sorted(f"{s}{t}{mb}" for s in range(2 * p) for t in "FB" for mb in range(m))


@pytest.mark.parametrize("p, m", SIZES)
def test_a_result_is_handed_on_at_the_commit_that_sends_it(ds, p, m):
    # A Send* only queues; the next CommitP2P runs it. The replay hands a block's results on when
    # the block ends, so a sent compute's block must end at the last compute before that commit.
    blocks = dualpipev_schedule_order(p, m)
    for rank in range(p):
        cmds = stream(ds, p, m, rank)
        block_end = {}
        for block in blocks[rank]:
            members = list(block) if isinstance(block, ps.Overlap) else [block]
            block_end.update({a: members[-1] for a in members})
        computes = [(i, cmd) for i, cmd in enumerate(cmds) if type(cmd) in (ds.ForwardPass, ds.BackwardPass)]
        actions = ps.normalize(blocks)[rank]
        of_buffer = {(type(cmd), cmd.buffer_id): actions[n] for n, (_, cmd) in enumerate(computes)}
        sends = {ds.SendActivation: ds.ForwardPass, ds.SendGrad: ds.BackwardPass}
        checked = 0
        for i, cmd in enumerate(cmds):
            if type(cmd) not in sends:
                continue
            commit = next(j for j in range(i, len(cmds)) if type(cmds[j]) is ds.CommitP2P)
            last = [n for n, (j, _) in enumerate(computes) if j < commit][-1]
            assert block_end[of_buffer[sends[type(cmd)], cmd.buffer_id]] == actions[last]
            checked += 1
        assert checked == (4 * m if 0 < rank < p - 1 else 2 * m)  # the V turns on its end ranks


@pytest.mark.usefixtures("ds")  # the order is built from deepspeed's own schedule
def test_p2_m4_blocks():
    # Rank 0 runs its third phase-0 forward, commits (receiving 3F0's input), runs 3F0, and only
    # then queues both activations: 0F2's leaves with 3F0's, so the two are one block.
    order = {r: [str(b) for b in blocks] for r, blocks in dualpipev_schedule_order(2, 4).items()}
    assert order[0][:4] == ["0F0", "0F1", "(0F2;3F0)OVERLAP_F_B", "3B0"]
    assert order[1][0] == "(1F0;2F0)OVERLAP_F_B"  # 1F0 is not sent (the V turns on rank 1)


@pytest.mark.usefixtures("ds")
@pytest.mark.parametrize("p, m", SIZES)
def test_the_replay_fills_1f1bs_bubble(p, m):
    # Uniform stages: every rank idles alike, less than 1F1B's (p-1)/(m+p-1) at the same p and m,
    # and by the same seconds whatever m (only the fill and the drain idle).
    durations = {"F": 0.04, "B": 0.08}
    result = ps.simulate(dualpipev_schedule_order(p, m), durations)
    bubbles = list(result.bubble.values())
    assert max(bubbles) - min(bubbles) < 1e-12
    assert bubbles[0] < theoretical("1f1b", p, m)
    more = ps.simulate(dualpipev_schedule_order(p, m + 3), durations)
    assert more.idle[0] == pytest.approx(result.idle[0], abs=1e-9)
