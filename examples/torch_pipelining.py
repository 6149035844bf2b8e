"""PyTorch's own pipelining, watched by parwatch: every schedule class, synthetic compute.

    torchrun --nproc-per-node 2 examples/torch_pipelining.py --schedule 1f1b --microbatches 4 \\
        --synthetic-ms 40,80 --steps 6 --parwatch-log runs/pp

Each virtual stage (v = --chunks of them per rank) is a small linear layer that also
sleeps, per microbatch, F ms in its forward and B ms in its backward, half on the input
path and half on the weight path, so schedules that split the backward (I, W) sleep B/2 in
each. (torch runs the first stage's input backward inside its weight backward, so there I
is ~0 and W is B.) Bubbles are then checkable on CPU. Summaries land in --parwatch-log in
the usual format; rank 0's carry the whole pipeline's view.

The parwatch lines are marked `# parwatch`; everything else is plain torch pipelining.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from parwatch.trainer import faults as injection  # the injected faults (not part of watching)
from parwatch.vocabulary import SCHEDULES as REGISTRY  # parwatch: its schedule names

SCHEDULES = {s.name: s for s in REGISTRY.values() if s.torch_class is not None}
"""--schedule -> parwatch's registry entry: torch class, allowed and default --chunks, stage layout."""
ALIASES = {alias: s.name for s in SCHEDULES.values() for alias in s.aliases}


class SleepInBackward(torch.autograd.Function):
    """Identity forward; sleeps in backward (synthetic backward compute)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SyntheticStage(torch.nn.Module):
    """One virtual stage: y = tanh(x W^T + b), sleeping fwd_s in forward and bwd_s in backward."""

    def __init__(self, hidden: int, fwd_s: float, bwd_s: float, first: bool, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(hidden, hidden, generator=gen) / hidden**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(hidden))
        self.fwd_s, self.bwd_s, self.first = fwd_s, bwd_s, first

    def forward(self, x):
        time.sleep(self.fwd_s)
        if self.first and not x.requires_grad:  # so the input half of the backward runs (and sleeps) here too
            x = x.detach().requires_grad_()
        x = SleepInBackward.apply(x, self.bwd_s / 2)  # input path: the I half
        weight = SleepInBackward.apply(self.weight, self.bwd_s / 2)  # weight path: the W half
        return torch.tanh(F.linear(x, weight, self.bias))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--schedule", choices=sorted([*SCHEDULES, *ALIASES]), default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4, help="m, microbatches per step")
    ap.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="v, stages per rank (gpipe/1f1b: 1; zbv/dualpipev: 2; interleaved: default 2)",
    )
    ap.add_argument(
        "--synthetic-ms", default="40,80", help="F,B: forward and backward ms per microbatch per virtual stage"
    )
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--run-id", default="", help="default: a new id, shared by the ranks")
    ap.add_argument("--parwatch-log", default="", help="run directory for summaries.jsonl / spans.jsonl")
    ap.add_argument("--parwatch-endpoint", default="", help="sidecar URL (empty: none)")
    ap.add_argument("--parwatch-token-file", default="", help="file holding the sidecar's token")
    ap.add_argument("--no-parwatch", action="store_true", help="run the same training without parwatch")
    ap.add_argument("--losses-out", default="", help="rank holding the last stage writes its losses (JSON)")
    ap.add_argument("--checkpoint-dir", default="", help="per-rank checkpoints after every step (rollback)")
    ap.add_argument("--slow-stage", default="", help="RANK:FACTOR: that rank's compute takes FACTOR times longer")
    ap.add_argument("--send-delay-ms", default="", help="RANK:MS: that rank stalls MS before each activation send")
    injection.add_flags(ap)  # --inject SPEC, --pre-step-check on|off
    ap.add_argument("--hang-at", default="", help="RANK:STEP: that rank blocks in its forward at that step")
    ap.add_argument("--crash-at", default="", help="RANK:STEP: that rank exits hard in its forward at that step")
    args = ap.parse_args(argv)
    args.schedule = ALIASES.get(args.schedule, args.schedule)
    allowed, default = SCHEDULES[args.schedule].chunks, SCHEDULES[args.schedule].default_chunks
    args.chunks = default if args.chunks is None else args.chunks
    if allowed is not None and args.chunks not in allowed:
        ap.error(f"--chunks {args.chunks}: --schedule {args.schedule} needs --chunks {allowed[0]}")
    if args.chunks < 1 or args.microbatches < 1 or args.steps < 1:
        ap.error("--chunks, --microbatches and --steps must be >= 1")
    try:
        args.fwd_ms, args.bwd_ms = (float(x) for x in args.synthetic_ms.split(","))
    except ValueError:
        ap.error(f"--synthetic-ms {args.synthetic_ms!r}: give F,B in ms, e.g. 40,80")
    args.slow = _rank_value(ap, "--slow-stage", args.slow_stage)
    args.send_delay = _rank_value(ap, "--send-delay-ms", args.send_delay_ms)
    args.faults = injection.parsed(ap, args)
    args.hang = _rank_value(ap, "--hang-at", args.hang_at)
    args.crash = _rank_value(ap, "--crash-at", args.crash_at)
    return args


def _rank_value(ap, flag: str, text: str):
    if not text:
        return None
    try:
        rank, value = text.split(":")
        return int(rank), float(value)
    except ValueError:
        ap.error(f"{flag} {text!r}: give RANK:VALUE, e.g. 1:1.5")


def stage_indices(schedule: str, rank: int, pp: int, chunks: int) -> list[int]:
    """Virtual stages this rank holds: rank, rank+p, ... (looped) or rank and 2p-1-rank (V)."""
    if SCHEDULES[schedule].v_shape:
        return [rank, 2 * pp - 1 - rank]
    return [rank + c * pp for c in range(chunks)]


def build(args, rank: int, pp: int, fault: dict | None = None):
    """This rank's stages, schedule and optimizer; `fault["factor"]` multiplies each loss (an injected fault)."""
    fault = {"factor": 1.0} if fault is None else fault
    n_stages = pp * args.chunks
    factor = args.slow[1] if args.slow and args.slow[0] == rank else 1.0
    fwd_s = args.fwd_ms / 1000 * factor
    bwd_s = args.bwd_ms / 1000 * factor
    stages, modules = [], []
    for index in stage_indices(args.schedule, rank, pp, args.chunks):
        module = SyntheticStage(args.hidden, fwd_s, bwd_s, index == 0, args.seed * 1000 + index)
        modules.append(module)
        stages.append(PipelineStage(module, index, n_stages, torch.device("cpu")))
    if args.send_delay and args.send_delay[0] == rank:
        for stage in stages:
            _delay_sends(stage, args.send_delay[1] / 1000)
    for at, crash in ((args.hang, False), (args.crash, True)):  # --hang-at / --crash-at RANK:STEP
        if at and at[0] == rank:
            modules[0].register_forward_pre_hook(
                lambda module, inputs, step=int(at[1]), crash=crash: _fault(step, crash)
            )
    cls = getattr(torch_schedules, SCHEDULES[args.schedule].torch_class)

    def loss_fn(output, target):  # an injected fault scales this pass's loss (x NaN, x a spike's factor)
        loss = F.mse_loss(output, target)
        return loss * fault["factor"] if fault["factor"] != 1.0 else loss

    if SCHEDULES[args.schedule].one_chunk:
        schedule = cls(stages[0], args.microbatches, loss_fn=loss_fn)
    else:
        schedule = cls(stages, args.microbatches, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    return schedule, modules, torch.optim.SGD(params, lr=args.lr)


NOW = {"step": 0}
"""The step being trained (the loop sets it): injected faults strike at theirs."""


def _fault(step: int, crash: bool) -> None:
    """At `step`, in this rank's first stage's forward: block for good (a hung rank) or exit hard (a crash)."""
    if NOW["step"] != step:
        return
    if crash:
        print(f"injected crash at step {step}, exiting at {time.time():.3f}", flush=True)
        os._exit(17)
    print(f"injected hang at step {step}, blocking at {time.time():.3f}", flush=True)
    time.sleep(3600)


def _delay_sends(stage, seconds: float) -> None:
    build_ops = stage.get_fwd_send_ops

    def get_fwd_send_ops(chunk_id, *a, **kw):
        ops = build_ops(chunk_id, *a, **kw)
        if ops:
            time.sleep(seconds)
        return ops

    stage.get_fwd_send_ops = get_fwd_send_ops


def batch(args, step: int):
    gen = torch.Generator().manual_seed(args.seed * 7919 + step)
    n = args.microbatches * args.microbatch_size
    return torch.randn(n, args.hidden, generator=gen), torch.randn(n, args.hidden, generator=gen)


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    train(args)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def train(args) -> dict:
    """One run on this rank (the process group is up).

    Returns {"losses": {step: loss} of the surviving timeline, "history": [(step, loss)] of every
    step run (both on the rank holding the last stage only), "applied": the directives handled}."""
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    fault = {"factor": 1.0}
    faults = injection.Faults(args.faults, rank, rank)
    schedule, modules, optimizer = build(args, rank, pp, fault)
    holds_last = pp * args.chunks - 1 in stage_indices(args.schedule, rank, pp, args.chunks)

    def save(step: int) -> None:
        path = os.path.join(args.checkpoint_dir, f"step{step}-rank{rank}.pt")
        torch.save({"model": [m.state_dict() for m in modules], "optimizer": optimizer.state_dict()}, path)

    def load_checkpoint(step):  # parwatch: rollback directives call this on every rank
        steps = sorted(
            int(f.split("-")[0][4:]) for f in os.listdir(args.checkpoint_dir) if f.endswith(f"-rank{rank}.pt")
        )
        target = step if step in steps else max([s for s in steps if step is None or s < step], default=None)
        if target is None:
            raise FileNotFoundError(f"no checkpoint at or before step {step} in {args.checkpoint_dir}")
        state = torch.load(os.path.join(args.checkpoint_dir, f"step{target}-rank{rank}.pt"))
        for module, sd in zip(modules, state["model"]):
            module.load_state_dict(sd)
        optimizer.load_state_dict(state["optimizer"])
        return target

    watch = collector = None
    if not args.no_parwatch:
        from parwatch.collector import Collector, attach  # parwatch
        from parwatch.integrations import shared_run_id  # parwatch
        from parwatch.integrations.torch_pipelining import PipelineWatch  # parwatch

        watch = PipelineWatch(
            schedule,
            run_id=args.run_id or shared_run_id(),  # parwatch: rank 0's new id, on every rank
            load_checkpoint=load_checkpoint if args.checkpoint_dir else None,
            check=args.pre_step_check == "on",
        )
        collector = attach(
            Collector(  # parwatch
                watch.run_context(),
                endpoint=args.parwatch_endpoint or None,
                token=_token(args),
                log_path=os.path.join(args.parwatch_log, "summaries.jsonl") if args.parwatch_log else None,
                spans_path=os.path.join(args.parwatch_log, "spans.jsonl") if args.parwatch_log else None,
            )
        )
    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
    losses: dict[int, float] = {}  # step -> loss of the surviving timeline
    history: list = []  # (step, loss) of every step run, rolled back or not
    step = watch.start() if watch else 0  # parwatch

    def forward_backward(trained: int, data_step: int, x, y, mb_losses: list) -> None:
        """One step's forward and backward on its microbatches (again, for a re-run), from zeroed gradients."""
        optimizer.zero_grad()
        mb_losses.clear()
        fault["factor"] = faults.loss_factor(trained, data_step)
        schedule.step(x, target=y, losses=mb_losses)
        if faults.corrupt_grads_now(trained):
            modules[0].weight.grad.view(-1)[0] = float("nan")

    while step < args.steps:
        trained = step + 1
        data_step = trained + (watch.data_offset if watch else 0)  # parwatch: batches rollbacks skipped
        NOW["step"] = trained
        with watch.data() if watch else nullcontext():  # parwatch: data wait, timed
            x, y = batch(args, data_step)
        mb_losses: list = []
        forward_backward(trained, data_step, x, y, mb_losses)
        if watch:  # parwatch: the check (a bad step re-run or skipped), then optimizer.step()
            watch.optimizer_step(optimizer, rerun=partial(forward_backward, trained, data_step, x, y, mb_losses))
        else:
            optimizer.step()
        if mb_losses:
            losses[trained] = float(torch.stack([t.detach() for t in mb_losses]).mean())
            history.append((trained, losses[trained]))
        # parwatch: the step boundary; may pause or roll back (after the last step, once the last steps are judged)
        step = watch.step_done(last=trained == args.steps) if watch else trained
        if step != trained:  # rolled back: the steps after the loaded one are gone
            losses = {s: v for s, v in losses.items() if s <= step}
        elif args.checkpoint_dir:
            with watch.checkpoint() if watch else nullcontext():  # parwatch: checkpoint save, timed
                save(step)
            if watch:
                watch.checkpoint_saved(step)  # parwatch
    if watch:
        watch.close()  # parwatch
        collector.close()  # parwatch
    if args.losses_out and holds_last:
        with open(args.losses_out, "w") as f:
            json.dump({str(s): repr(v) for s, v in sorted(losses.items())}, f)
    return {
        "losses": losses if holds_last else {},
        "history": history if holds_last else [],
        "rank": rank,
        "applied": watch.applied if watch else [],
    }


def _token(args):
    """--parwatch-token-file, else $PARWATCH_TOKEN, else None."""
    from parwatch.tokens import read_token

    return read_token(args.parwatch_token_file, flag="--parwatch-token-file")


if __name__ == "__main__":
    sys.exit(main())
