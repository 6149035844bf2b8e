"""Evidence at a hang across two loopback nodes (issue 44, item 3): each node its own `torchrun --nnodes 2
--node-rank K` with its own sidecar (test_multinode.py's Node), node 1's forwarding to the leader. Rank 3
(node 1) hangs in its forward; the leader's decision names its evidence bundle, and the bundle holds every
rank's Python stacks (all threads), last spans, activity and Flight Recorder dump: node 0's ranks sent
theirs to the leader directly, node 1's through their node's sidecar."""

from __future__ import annotations

import json
import os

import pytest
from e2e_util import TORCHRUN, wait_until
from test_multinode import Node, torchrun_nodes

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun is not installed next to this Python"),
]


def test_a_hang_across_two_nodes_keeps_every_ranks_stacks_beside_the_decision(tmp_path):
    leader = Node(tmp_path, "node0")
    node1 = Node(tmp_path, "node1", "--leader-url", leader.control_url)
    try:
        leader.start()
        node1.start()
        with torchrun_nodes(tmp_path, [leader, node1], 200, "--inject", "hang:rank=3,step=8,where=compute"):
            (hang,) = wait_until(
                lambda: [d for d in leader.records("decision") if d["rule"] == "hang"], "the hang", 150
            )
            bundle = leader.state_dir / hang["evidence"]["bundle"]
            files = wait_until(
                lambda: len(list(bundle.glob("rank*.json"))) == 4 and sorted(bundle.glob("rank*.json")),
                "every rank's evidence",
                30,
            )
            arrived = max(f.stat().st_mtime for f in files) - hang["time"]
            status = leader.status()["evidence"][-1]
    finally:
        node1.stop()
        leader.stop()
    print(f"\nevery rank's evidence kept {arrived:.2f} s after the decision")
    assert hang["evidence"]["culprit"]["rank"] == 3 and hang["evidence"]["kind"] == "host", hang["reason"]
    assert status["ranks"] == [0, 1, 2, 3] and status["expected"] == [0, 1, 2, 3], status
    assert not (node1.state_dir / "evidence").exists()
    for f in files:
        ev = json.loads(f.read_text())
        rank = ev["rank"]
        assert f.name == f"rank{rank}.json" and ev["decision"] == hang["id"]
        stacks = ev["stacks"]
        assert '"MainThread"' in stacks and '"parwatch-activity"' in stacks, (rank, stacks[:500])
        assert "train.py" in stacks, (rank, stacks[-2000:])  # the training thread, where it waits
        if rank == 3:
            assert "hang_if" in stacks and ev["activity"]["kind"] == "forward"
        assert 0 < len(ev["spans"]) <= 64 and ev["activity"]["rank"] == rank
        fr = ev["flight_recorder"]
        assert fr["path"] and fr["entries"] > 0 and os.path.getsize(fr["path"]) > 0, fr  # parwatch's launcher set it on
