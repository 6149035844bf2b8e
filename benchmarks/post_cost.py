"""The sidecar's CPU per node digest, closed loop: how much of a leader's core one post costs.

    python benchmarks/post_cost.py [--posts 6000] [--connections 32] [--runs 3]

A real sidecar takes --posts digests (8 ranks each, of a 16,384-rank run) as fast as --connections
keep-alive connections send them; the sidecar's user + system CPU over the posts, per post. No goal:
the figure behind the leader's ingest latency (benchmarks/scale.py) and the HTTP path's choices
(docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import cpu_jiffies, stolen_share, write_json  # noqa: E402

from benchmarks.hang_detection import PER_NODE, _layout, _row  # noqa: E402
from benchmarks.sidecar_load import Connection, cpu_seconds  # noqa: E402
from tests.sidecar_process import running_sidecar  # noqa: E402


def _digest(node: int, step: int, now: float) -> bytes:
    lay = _layout(16384)
    rows = [
        _row(r, lay, step, "forward", since=now, now=now, step_end=now)
        for r in range(node * PER_NODE, (node + 1) * PER_NODE)
    ]
    return json.dumps(
        {
            "version": 1,
            "node": f"node{node}",
            "run_id": "sim",
            "time": now,
            "layout": [lay.tp, lay.pp, lay.dp],
            "rows": rows,
        },
        separators=(",", ":"),
    ).encode()


async def _drive(url: str, token: str, pid: int, posts: int, connections: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    now = time.time()
    bodies = [_digest(n % 2048, 1 + n // 2048, now) for n in range(posts)]
    queue: asyncio.Queue = asyncio.Queue()

    async def worker(conn: Connection) -> None:
        while not queue.empty():
            status = await conn.post("/v1/digest", queue.get_nowait())
            if status != 200:
                raise RuntimeError(f"digest refused: HTTP {status}")

    conns = [Connection(host, int(port), token) for _ in range(connections)]
    for body in bodies[:200]:  # warm up: routes built, connections open
        queue.put_nowait(body)
    await asyncio.gather(*(worker(c) for c in conns))
    for body in bodies:
        queue.put_nowait(body)
    cpu, t0, jiffies = cpu_seconds(pid), time.perf_counter(), cpu_jiffies()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - t0
    return {
        "posts_per_s": posts / elapsed,
        "sidecar_cpu_ms_per_post": (cpu_seconds(pid) - cpu) / posts * 1e3,
        "cpu_stolen_share": stolen_share(jiffies, cpu_jiffies()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--posts", type=int, default=6000)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/post_cost.json"))
    args = p.parse_args(argv)
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp, running_sidecar(Path(tmp) / "state") as sp:
            runs.append(asyncio.run(_drive(sp.control_url, sp.token, sp.pid, args.posts, args.connections)))
        r = runs[-1]
        print(
            f"run {i + 1}/{args.runs}: {r['sidecar_cpu_ms_per_post']:.3f} ms of sidecar CPU per digest, "
            f"{r['posts_per_s']:.0f} posts/s, stolen CPU {r['cpu_stolen_share']:.0%}",
            flush=True,
        )
    write_json(args.out, {"posts": args.posts, "connections": args.connections, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
