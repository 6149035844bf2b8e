"""The fault campaign's --inject kinds (issue 44) through the real trainer on real gloo ranks: what
each one does to the spans, and where each new hang place leaves the rank that blocks and its peer.

One 2-rank spawn runs the timed kinds one after the other (slow checkpoint, eval pause, warm-up, a
hiccup in the training thread and one of the whole process); one spawn per new hang place (backward,
recv, boundary) runs the trainer on a thread until the injected rank blocks, then reads both ranks'
innermost open span, which is what their activity reports show the sidecar.
"""

from __future__ import annotations

import pytest

from tests.distutil import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

SMALL = dict(layers=2, hidden=16, heads=2, vocab=32, seq_len=8, micro_batch_size=1, microbatches=2, pp=2)
SYNTHETIC = "fwd_ms=2,bwd_ms=4"
MS = 300.0
RUNS = {
    "baseline": dict(steps=4),
    "slow-checkpoint": dict(steps=4, checkpoint_every=2, inject=[f"slow-checkpoint:ms={MS:g}"]),
    "eval": dict(steps=4, inject=[f"eval-pause:every=2,ms={MS:g}"]),
    "warmup": dict(steps=3, inject=[f"warmup:ms={MS:g}"]),
    "hiccup-sleep": dict(steps=4, inject=[f"hiccup:rank=1,step=3,ms={MS:g},how=sleep"]),
    "hiccup-stop": dict(steps=4, inject=[f"hiccup:rank=1,step=3,ms={MS:g},how=stop"]),
}


def _recorder():
    from parwatch import contract

    class Spans(contract.Observer):
        """(kind, seconds, step attr) of every span, and each boundary's host time."""

        def __init__(self):
            self.spans, self.boundaries = [], []

        def on_span(self, span):
            self.spans.append((str(span.kind), (span.end - span.start) * 1e-9, span.attrs.get("step")))

        def on_boundary(self, info, slots):
            import time

            self.boundaries.append((info.step, time.perf_counter()))

    return Spans()


def _timed_kinds(rank: int, world_size: int, checkpoint_root: str) -> dict:
    import os

    from parwatch import contract
    from parwatch.trainer.config import TrainConfig
    from parwatch.trainer.train import Trainer

    out = {}
    for name, settings in RUNS.items():
        contract.registry.clear()
        recorder = _recorder()
        contract.registry.register(recorder)
        extra = {"checkpoint_dir": os.path.join(checkpoint_root, name)} if "checkpoint_every" in settings else {}
        Trainer(TrainConfig(**SMALL, **settings, **extra, synthetic_compute=SYNTHETIC), rank, world_size).run()
        contract.registry.clear()
        gaps = {step: t - recorder.boundaries[i - 1][1] for i, (step, t) in enumerate(recorder.boundaries) if i}
        out[name] = {"spans": recorder.spans, "gaps": gaps}
    return out


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    return run_ranks(_timed_kinds, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=180)


def _spans(run, kind):
    return [(s, step) for k, s, step in run["spans"] if k == kind]


def test_slow_checkpoint_lengthens_every_save_inside_its_span(timed):
    for r in timed:
        saves = _spans(r["slow-checkpoint"], "checkpoint")
        assert [step for _, step in saves] == [2, 4], saves
        assert all(s >= MS / 1000 for s, _ in saves), saves
        assert not _spans(r["baseline"], "checkpoint")


def test_eval_pause_runs_an_eval_span_every_n_steps_on_every_rank(timed):
    for r in timed:
        evals = _spans(r["eval"], "eval")
        assert [step for _, step in evals] == [2, 4] and all(s >= MS / 1000 for s, _ in evals), evals
        # The pause lies between two boundaries: the step after it is that much longer.
        assert r["eval"]["gaps"][3] >= MS / 1000 > r["baseline"]["gaps"][3], (r["eval"]["gaps"], r["baseline"]["gaps"])


def test_warmup_lengthens_only_the_first_steps_first_forward(timed):
    for r in timed:
        forwards = [s for s, _ in _spans(r["warmup"], "forward")]
        assert forwards[0] >= MS / 1000 and max(forwards[1:]) < MS / 1000, forwards
        assert r["warmup"]["gaps"][1] >= MS / 1000 > max(r["warmup"]["gaps"][2], r["warmup"]["gaps"][3])


@pytest.mark.parametrize("how", ["sleep", "stop"])
def test_hiccup_stops_its_rank_once_for_its_length_then_training_goes_on(timed, how):
    run = [r[f"hiccup-{how}"] for r in timed]
    for r in run:  # both ranks: the peer waits for the stopped one at the boundary
        assert r["gaps"][3] >= MS / 1000 > max(r["gaps"][2], r["gaps"][4]), r["gaps"]
    # Inside no span of rank 1's own (it happens before the step's work): its forwards stay short.
    assert max(s for s, _ in _spans(run[1], "forward")) < MS / 1000


def _blocked_at(rank: int, world_size: int, where: str, tp: int) -> dict:
    """Train on a thread with a hang at `where` on the last rank; once it logged its block and the other ranks'
    open span stopped changing, each rank's innermost open span (what its activity reports)."""
    import threading
    import time

    from parwatch import contract
    from parwatch.trainer.config import TrainConfig
    from parwatch.trainer.train import Trainer

    contract.registry.clear()
    contract.registry.register(contract.Observer())  # spans are opened (and numbered) only when observed
    settings = dict(SMALL, tp=tp, heads=2, steps=20, synthetic_compute=SYNTHETIC)
    cfg = TrainConfig(**settings, inject=[f"hang:rank={world_size - 1},step=3,where={where}"])
    trainer = Trainer(cfg, rank, world_size)
    threading.Thread(target=trainer.run, daemon=True).start()
    last, stable_since, deadline = None, time.monotonic(), time.monotonic() + 60
    while time.monotonic() < deadline:
        span = contract.registry.current
        now = (span.kind, dict(span.attrs)) if span is not None else (None, {})
        seen = (id(span), now[0])
        if seen != last:
            last, stable_since = seen, time.monotonic()
        elif time.monotonic() - stable_since > 2.0 and trainer.step >= 2:
            break
        time.sleep(0.05)
    kind, attrs = now
    sent = {peer: n for (k, peer), n in contract.registry.sequence.items() if k == contract.SpanKind.SEND}
    # No rank returns (and so closes its connections) before every rank has sampled: a rank that left first
    # failed its peer's boundary all-reduce ("Connection closed by peer"), which then read between spans
    # (half the runs failed so). The process group's store answers while the training threads are blocked.
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    for key in ("sampled", "done"):  # rank 0 holds the store: it leaves only once every rank read its last
        store.add(key, 1)
        while (key == "sampled" or rank == 0) and store.add(key, 0) < world_size and time.monotonic() < deadline + 30:
            time.sleep(0.05)
    return {
        "kind": None if kind is None else str(kind),
        "peer": attrs.get("peer"),
        "seq": attrs.get("seq"),
        "group": attrs.get("group"),
        "step": trainer.step,
        "sent": sent,
    }


@pytest.mark.parametrize("where", ["backward", "recv", "boundary"])
def test_a_hang_place_leaves_the_blocked_rank_where_its_activity_says(where):
    ranks = run_ranks(_blocked_at, 2, where, 1, timeout=120)
    hung, peer = ranks[1], ranks[0]
    trained = 3 if where == "boundary" else 2  # it blocked in step 3 (at its boundary: after its work), alive
    assert hung["step"] == trained and peer["step"] == trained, ranks
    if where == "backward":
        assert hung["kind"] == "backward", hung
        assert peer["kind"] == "recv" and peer["peer"] == 1, peer  # stage 0 waits for its gradient
    elif where == "recv":
        # Rank 1 (stage 1) is in its receive of step 3's first activation, which rank 0 had posted:
        # the k-th receive from rank 0 has a send numbered k posted (the sidecar reads it as answered).
        assert (hung["kind"], hung["peer"]) == ("recv", 0), hung
        assert peer["sent"][1] >= hung["seq"], (peer, hung)
    else:  # between spans, before the boundary; its peer in the boundary's all-reduce
        assert hung["kind"] is None, hung
        assert (peer["kind"], peer["group"]) == ("boundary", "world"), peer
