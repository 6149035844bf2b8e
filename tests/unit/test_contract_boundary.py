"""The step boundary of parwatch.contract, driven by simulated ranks (threads and a summing barrier).

Every rank runs the same StepBoundary code a trainer runs; the all-reduce is a barrier that adds
up the ranks' vectors, as a SUM all-reduce does. So the protocol (directive to every rank at the
same boundary, every rank's outcome counted, another run's directive ignored, pause held in
heartbeats, agreement on a rollback target) is checked without torch.
"""

from __future__ import annotations

import threading

import pytest

from parwatch.contract import (
    HEADER_SLOTS,
    Action,
    BoundaryKind,
    Directive,
    FailReason,
    HookRegistry,
    Observer,
    Outcome,
    StepBoundary,
    Unresumable,
)


class SumAllReduce:
    """A world of `n` threads: each call blocks until all n contributed, then returns the sum."""

    def __init__(self, n: int):
        self.n = n
        self.lock = threading.Condition()
        self.parts: list = []
        self.result = None
        self.generation = 0
        self.widths: list[int] = []

    def __call__(self, values: list) -> list:
        with self.lock:
            gen = self.generation
            self.parts.append(list(values))
            if len(self.parts) == self.n:
                assert len({len(p) for p in self.parts}) == 1, "ranks disagree on the vector width"
                self.widths.append(len(values))
                self.result = [sum(col) for col in zip(*self.parts)]
                self.parts = []
                self.generation += 1
                self.lock.notify_all()
            else:
                assert self.lock.wait_for(lambda: self.generation != gen, timeout=10), "a rank never arrived"
            return list(self.result)


class Offer(Observer):
    """Rank 0's source of directives (the collector's inbox in real runs)."""

    def __init__(self, directives=()):
        self.queue = list(directives)
        self.infos = []

    def pending_directive(self):
        return self.queue.pop(0) if self.queue else None

    def directs(self):
        return True

    def on_boundary(self, info, slots):
        self.infos.append(info)


def run_world(n: int, body, run_id: str = "run-a", directives=()):
    """Run body(rank, boundary, registry) on n threads; returns each rank's result and rank 0's observer."""
    reduce = SumAllReduce(n)
    results, errors = [None] * n, []
    offer = Offer(directives)

    def rank_main(rank):
        registry = HookRegistry()
        registry.register(offer if rank == 0 else Observer())
        boundary = StepBoundary(rank, n, run_id, reduce, reports_loss=rank == n - 1, registry=registry)
        try:
            results[rank] = body(rank, boundary, registry)
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return results, offer, reduce


def pause(did=5, run_id="run-a"):
    return Directive(id=did, action=Action.PAUSE, run_id=run_id)


def test_every_rank_gets_the_directive_and_the_loss_at_the_same_boundary():
    def body(rank, b, reg):
        b.exchange(BoundaryKind.START, 0)
        return b.exchange(BoundaryKind.STEP, 1, loss=2.5 if rank == 3 else None)

    results, _, _ = run_world(4, body, directives=[pause()])
    for loss, directive in results:
        assert loss == 2.5 and directive == Directive(5, Action.PAUSE, "run-a")


def test_the_width_does_not_grow_with_the_world():
    def body(rank, b, reg):
        b.exchange(BoundaryKind.START, 0)

    widths = [run_world(n, body)[2].widths[0] for n in (1, 2, 8)]
    assert widths == [HEADER_SLOTS] * 3


def test_rank_0_learns_every_ranks_outcome_from_the_counts():
    def body(rank, b, reg):
        b.exchange(BoundaryKind.START, 0)
        _, directive = b.exchange(BoundaryKind.STEP, 1)
        b.report(directive, Outcome.SUBSTITUTED, loaded_step=0, step=1)  # step 0: loaded_step 0 is a step
        b.exchange(BoundaryKind.RESUME, 0)
        b.exchange(BoundaryKind.STEP, 1)

    rollback = Directive(id=9, action=Action.ROLLBACK, run_id="run-a", to_step=4)
    _, offer, _ = run_world(3, body, directives=[rollback])
    start, step, resume, again = (i.report for i in offer.infos)
    assert not start.complete and not step.complete
    assert resume.complete and resume.directive_id == 9 and resume.outcome == Outcome.SUBSTITUTED
    assert (resume.loaded_step, resume.ranks) == (0, 3)
    assert again == resume  # the outcome rides every boundary until the next directive


def test_ranks_that_disagree_are_reported_as_mixed_with_their_reasons():
    def body(rank, b, reg):
        b.exchange(BoundaryKind.START, 0)
        _, d = b.exchange(BoundaryKind.STEP, 1)
        if rank == 1:
            b.report(d, Outcome.FAILED, reason=FailReason.LOAD_ERROR)
        else:
            b.report(d, Outcome.APPLIED)
        b.exchange(BoundaryKind.STEP, 2)

    _, offer, _ = run_world(2, body, directives=[pause(6)])
    report = offer.infos[-1].report
    assert report.complete and report.outcome is None
    assert report.counts[Outcome.APPLIED] == 1 and report.counts[Outcome.FAILED] == 1
    assert report.reasons == {FailReason.LOAD_ERROR: 1}


def test_a_directive_for_another_run_is_ignored_and_reported():
    def body(rank, b, reg):
        b.exchange(BoundaryKind.START, 0)
        _, directive = b.exchange(BoundaryKind.STEP, 1)
        b.exchange(BoundaryKind.STEP, 2)
        return directive

    results, offer, _ = run_world(2, body, directives=[pause(7, run_id="run-b")])
    assert results == [None, None]
    report = offer.infos[-1].report
    assert report.complete and report.outcome == Outcome.IGNORED
    assert report.reasons == {FailReason.OTHER_RUN: 2}


def test_a_directive_is_handed_over_once_per_id():
    def body(rank, b, reg):
        b.exchange(BoundaryKind.START, 0)
        return [b.exchange(BoundaryKind.STEP, s)[1] for s in (1, 2)]

    results, _, _ = run_world(2, body, directives=[pause(5), pause(5)])  # the sidecar repeats it
    assert all(r[0] is not None and r[1] is None for r in results)


def test_hold_runs_heartbeats_until_resume_then_a_resume_boundary():
    resume = Directive(id=11, action=Action.RESUME, run_id="run-a")

    def body(rank, b, reg):
        b.exchange(BoundaryKind.START, 0)
        _, d = b.exchange(BoundaryKind.STEP, 1)
        b.report(d, Outcome.APPLIED)
        return b.hold(1, 0.0)

    results, offer, _ = run_world(2, body, directives=[pause(10), None, None, resume])
    assert results == [None, None]
    kinds = [i.kind for i in offer.infos]
    assert kinds == ["start", "step", "heartbeat", "heartbeat", "heartbeat", "resume"]
    assert offer.infos[-1].report.directive_id == 11 and offer.infos[-1].report.complete


def test_a_pause_nothing_can_resume_stops_every_rank_instead_of_waiting_forever():
    """An unwatched run (or one whose collector has no sidecar) that its pre-step check pauses: rank 0 has
    no observer that directs, so every rank raises Unresumable at once rather than holding forever."""

    class Silent(Offer):
        def directs(self):
            return False

    def body(rank, b, reg):
        if rank == 0:
            reg.unregister(next(o for o in reg.observers if isinstance(o, Offer)))
            reg.register(Silent())
        b.exchange(BoundaryKind.START, 0)
        try:
            b.hold(3, 0.0)
        except Unresumable as err:
            return str(err)

    results, _, _ = run_world(2, body)
    assert all(r is not None and "paused at step 3" in r and "no parwatch sidecar" in r for r in results)


def test_an_observer_older_than_directs_that_offers_directives_still_directs():
    class Older:  # duck-typed, as observers may be: no `directs`
        def on_span(self, span):
            pass

        def pending_directive(self):
            return None

    class Spans:  # offers no directives at all
        def on_span(self, span):
            pass

    older, spans = HookRegistry(), HookRegistry()
    older.register(Older())
    spans.register(Spans())
    assert older.directed() and not spans.directed() and not HookRegistry().directed()


def test_a_rollback_while_paused_is_returned_to_the_caller():
    rollback = Directive(id=12, action=Action.ROLLBACK, run_id="run-a", to_step=2)

    def body(rank, b, reg):
        b.exchange(BoundaryKind.START, 0)
        _, d = b.exchange(BoundaryKind.STEP, 1)
        b.report(d, Outcome.APPLIED)
        return b.hold(1, 0.0)

    results, _, _ = run_world(2, body, directives=[pause(10), rollback])
    assert results == [rollback, rollback]


def test_agree_is_true_only_when_every_rank_says_ok():
    def body(rank, b, reg):
        return b.agree(True), b.agree(rank != 2)

    results, _, _ = run_world(3, body)
    assert results == [(True, False)] * 3


def test_a_boundary_without_observers_still_exchanges_the_loss():
    reduce = SumAllReduce(1)
    b = StepBoundary(0, 1, "r", reduce, reports_loss=True, registry=HookRegistry())
    assert b.exchange(BoundaryKind.STEP, 1, loss=1.5) == (1.5, None)


def test_bad_construction_names_the_problem():
    with pytest.raises(ValueError, match="rank=4"):
        StepBoundary(4, 4, "r", SumAllReduce(4), reports_loss=False)
    with pytest.raises(ValueError, match="run_id"):
        StepBoundary(0, 4, "", SumAllReduce(4), reports_loss=False)


def test_the_contract_and_the_collector_import_no_trainer_and_the_contract_nothing_heavy(tmp_path):
    """A trainer imports the contract alone; the collector never imports the reference trainer."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, parwatch.contract; heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'trainer', 'httpx', 'fastapi', 'pydantic') or m.startswith(('parwatch.collector', "
        "'parwatch.sidecar'))]; assert not heavy, heavy; import parwatch.collector; "
        "assert not [m for m in sys.modules if m.split('.')[0] == 'trainer']"
    )
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
