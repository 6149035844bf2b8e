"""A DeepSpeed pipeline (PipelineModule + PipelineEngine), watched by parwatch, synthetic compute.

    torchrun --nproc-per-node 2 examples/deepspeed_pipe.py --pp 2 --microbatches 4 \\
        --synthetic-ms 40,80 --steps 6 --parwatch-log runs/ds

Each stage is a small linear layer that also sleeps, per microbatch, F ms in its forward and B ms
in its backward, so bubbles are checkable on CPU (DeepSpeed picks its CPU accelerator and gloo
by itself). Summaries land in --parwatch-log in the usual format; rank 0's carry the whole
pipeline's view. The parwatch lines are marked `# parwatch`; the rest is plain DeepSpeed.

--schedule dualpipev builds a DualPipeVModule instead (2p layers, rank r holding layers r and
2p-1-r; DeepSpeed then runs its DualPipeVEngine, which needs --microbatches >= 2p).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parwatch.trainer import faults as injection  # the injected faults (not part of watching)


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
    """y = tanh(x W^T + b), sleeping fwd_s in forward and bwd_s in backward."""

    def __init__(self, hidden: int, fwd_s: float, bwd_s: float, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(hidden, hidden, generator=gen) / hidden**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(hidden))
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        time.sleep(self.fwd_s)
        if not x.requires_grad:  # the first stage: so its backward runs (and sleeps) too
            x = x.detach().requires_grad_()
        return torch.tanh(F.linear(SleepInBackward.apply(x, self.bwd_s), self.weight, self.bias))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (the world size must be a multiple)")
    ap.add_argument("--microbatches", type=int, default=4, help="m, microbatches per step")
    ap.add_argument(
        "--schedule",
        choices=("1f1b", "dualpipev"),
        default="1f1b",
        help="1f1b: PipelineModule (TrainSchedule); dualpipev: DualPipeVModule, two stages per rank",
    )
    ap.add_argument("--synthetic-ms", default="40,80", help="F,B: ms each stage sleeps per microbatch")
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
    ap.add_argument("--losses-out", default="", help="the last stage's first rank writes its losses (JSON)")
    ap.add_argument("--checkpoint-dir", default="", help="engine.save_checkpoint after every step (rollback)")
    ap.add_argument(
        "--slow-stage", default="", help="STAGE:FACTOR: that stage's (rank's) compute takes FACTOR times longer"
    )
    ap.add_argument("--send-delay-ms", default="", help="STAGE:MS: that stage stalls MS before each activation send")
    injection.add_flags(ap)  # --inject SPEC, --pre-step-check on|off
    ap.add_argument("--hang-at", default="", help="STAGE:STEP: that stage blocks in its forward at that step")
    ap.add_argument("--crash-at", default="", help="STAGE:STEP: that stage exits hard in its forward at that step")
    args = ap.parse_args(argv)
    if min(args.pp, args.microbatches, args.steps) < 1:
        ap.error("--pp, --microbatches and --steps must be >= 1")
    if args.schedule == "dualpipev" and args.microbatches < 2 * args.pp:
        ap.error(f"--schedule dualpipev needs --microbatches >= 2 * --pp ({2 * args.pp})")
    try:
        args.fwd_ms, args.bwd_ms = (float(x) for x in args.synthetic_ms.split(","))
    except ValueError:
        ap.error(f"--synthetic-ms {args.synthetic_ms!r}: give F,B in ms, e.g. 40,80")
    args.slow = _stage_value(ap, "--slow-stage", args.slow_stage)
    args.send_delay = _stage_value(ap, "--send-delay-ms", args.send_delay_ms)
    args.hang = _stage_value(ap, "--hang-at", args.hang_at)
    args.faults = injection.parsed(ap, args)
    args.crash = _stage_value(ap, "--crash-at", args.crash_at)
    return args


def _stage_value(ap, flag: str, text: str):
    if not text:
        return None
    try:
        stage, value = text.split(":")
        return int(stage), float(value)
    except ValueError:
        ap.error(f"{flag} {text!r}: give STAGE:VALUE, e.g. 1:1.5")


class Batches:
    """Microbatches (x, y), the same on every rank; step s's come from a seed of s. After a rollback
    training resumes at `seek(step)`."""

    def __init__(self, args) -> None:
        self.args, self.step, self.mb = args, 0, 0

    def seek(self, step: int) -> None:
        self.step, self.mb = step, 0

    def __iter__(self):
        return self

    def __next__(self):
        args = self.args
        if self.mb == 0:
            self.step += 1
        gen = torch.Generator().manual_seed(args.seed * 7919 + self.step * 1009 + self.mb)
        self.mb = (self.mb + 1) % args.microbatches
        shape = (args.microbatch_size, args.hidden)
        return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def build(args):
    import deepspeed
    from deepspeed.pipe import DualPipeVModule, LayerSpec, PipelineModule

    dualpipev = args.schedule == "dualpipev"
    n_layers = 2 * args.pp if dualpipev else args.pp  # one layer per (virtual) stage

    def stage_seconds(layer: int) -> tuple[float, float]:
        rank = min(layer, n_layers - 1 - layer) if dualpipev else layer  # DualPipeV: a V over the ranks
        factor = args.slow[1] if args.slow and args.slow[0] == rank else 1.0
        return args.fwd_ms / 1000 * factor, args.bwd_ms / 1000 * factor

    layers = [LayerSpec(SyntheticStage, args.hidden, *stage_seconds(s), args.seed * 1000 + s) for s in range(n_layers)]
    now = {"step": 0, "data_step": 0, "microbatch": 0}  # the step trained, its batch, the loss's microbatch
    faults: list = []  # Faults of this rank, once the engine knows its stage

    def loss_fn(output, target):
        loss = F.mse_loss(output, target)
        if now["microbatch"] % args.microbatches == 0:  # a pass's first loss: the fault of this pass
            now["factor"] = faults[0].loss_factor(now["step"], now["data_step"])
        now["microbatch"] += 1
        return loss * now["factor"] if now["factor"] != 1.0 else loss

    module_cls = DualPipeVModule if dualpipev else PipelineModule
    module = module_cls(layers=layers, num_stages=args.pp, loss_fn=loss_fn, partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": args.microbatch_size,
        "gradient_accumulation_steps": args.microbatches,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    optimizer = torch.optim.SGD(module.parameters(), lr=args.lr)
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    faults.append(injection.Faults(args.faults, dist.get_rank(), engine.stage_id))
    # sdc: this rank's gradients corrupted once, as its backward makes them
    next(iter(module.parameters())).register_hook(partial(_corrupt, faults[0], now))
    if args.send_delay and args.send_delay[0] == engine.stage_id:
        _delay_sends(engine, args.send_delay[1] / 1000)
    if args.hang and args.hang[0] == engine.stage_id:
        _hang_at(engine, int(args.hang[1]), now)
    if args.crash and args.crash[0] == engine.stage_id:
        _hang_at(engine, int(args.crash[1]), now, crash=True)
    return engine, now


def _corrupt(faults, now: dict, grad):
    """An sdc fault of this rank at this step (once): one element of a gradient becomes NaN."""
    if faults.corrupt_grads_now(now["step"]):
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
    return grad


def _delay_sends(engine, seconds: float) -> None:
    """This stage stalls before each activation send (a slow link, as the tests inject it)."""
    from deepspeed.runtime.pipe import schedule

    send = type(engine)._INSTRUCTION_MAP[schedule.SendActivation]

    def delayed(self, **kwargs):
        time.sleep(seconds)
        return send(self, **kwargs)

    engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, schedule.SendActivation: delayed}


def _hang_at(engine, step: int, now: dict, crash: bool = False) -> None:
    """This stage blocks for good in its first forward of `step` (a hung rank, as the tests inject it), or
    with `crash` exits hard there (a crashed rank)."""
    forward = engine.module.forward

    def hanging(*args, **kwargs):
        if now.get("step") == step and crash:
            print(f"injected crash at step {step}, exiting at {time.time():.3f}", flush=True)
            os._exit(17)
        if now.get("step") == step:
            print(f"injected hang at step {step}, blocking at {time.time():.3f}", flush=True)
            time.sleep(3600)
        return forward(*args, **kwargs)

    engine.module.forward = hanging


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    train(args)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def train(args) -> dict:
    """One run on this rank (the process group is up). Returns {"losses": {step: loss} of the
    surviving timeline, "applied": the directives handled, "engine": the DeepSpeed engine}."""
    torch.manual_seed(args.seed)
    engine, now = build(args)
    batches = Batches(args)
    watch = collector = None
    if not args.no_parwatch:
        from parwatch.collector import Collector, attach  # parwatch
        from parwatch.integrations import deepspeed as pw  # parwatch
        from parwatch.integrations import shared_run_id  # parwatch

        run_id = args.run_id or shared_run_id()  # parwatch: one id, from rank 0
        watch = pw.watch(  # parwatch
            engine,
            run_id=run_id,
            checkpoint_dir=args.checkpoint_dir or None,
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
    losses: dict[int, float] = {}
    step = watch.start() if watch else 0  # parwatch
    while step < args.steps:
        trained = step + 1
        now.update(step=trained, data_step=trained + (watch.data_offset if watch else 0), microbatch=0)
        loss = engine.train_batch(batches)  # parwatch: checked before its optimizer step (re-run, skipped)
        losses[trained] = float(loss)
        # parwatch: the boundary; may pause or roll back (after the last step, once the last steps are judged)
        step = watch.step_done(last=trained == args.steps) if watch else trained
        if step != trained:  # rolled back: the steps after the loaded one are gone
            losses = {s: v for s, v in losses.items() if s <= step}
            batches.seek(step + watch.data_offset)  # parwatch: past the batches the rollback skips
        elif args.checkpoint_dir:
            engine.save_checkpoint(args.checkpoint_dir)  # tag global_step<N>
    if watch:
        watch.close()  # parwatch
        collector.close()  # parwatch
    # the loss stage's first rank (DualPipeVEngine answers is_last_stage() so on rank 0 between phases)
    first_of_last = engine.is_last_stage() and engine.grid.get_data_parallel_id() == 0
    if args.losses_out and first_of_last:
        with open(args.losses_out, "w") as f:
            json.dump({str(s): repr(v) for s, v in sorted(losses.items())}, f)
    return {"losses": losses, "applied": watch.applied if watch else [], "engine": engine}


def _token(args):
    """--parwatch-token-file, else $PARWATCH_TOKEN, else None."""
    from parwatch.tokens import read_token

    return read_token(args.parwatch_token_file, flag="--parwatch-token-file")


if __name__ == "__main__":
    sys.exit(main())
