"""Megatron-Core's GPTModel (local layer spec, no Transformer Engine), TP x PP x DP with optional
interleaving, watched by parwatch; runs on CPU with gloo.

    torchrun --nproc-per-node 4 examples/megatron_gpt.py --tp 2 --pp 2 --microbatches 4 \\
        --synthetic-ms 40,80 --steps 6 --parwatch-log runs/megatron

DP is what the world leaves (world / (tp * pp)), laid out in Megatron's own order (--order, default
Megatron's "tp-cp-ep-dp-pp"); with DP > 1 the chunks are wrapped in Megatron's DistributedDataParallel,
each replica trains on its own batches, and Megatron's finalize_model_grads all-reduces the gradients.

Each model chunk (--chunks of them per pipeline rank) also sleeps, per microbatch, F ms at the
start of its forward (a forward pre-hook) and B ms at the start of its backward (a hook on its
output's gradient), so bubbles are checkable on CPU. Summaries land in --parwatch-log in the
usual format; rank 0's carry the whole pipeline's view. Without CUDA, examples/megatron_cpu.py's
shims are applied first.

The parwatch lines are marked `# parwatch`; everything else is plain Megatron-Core.
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

from parwatch.trainer import faults as injection  # the injected faults (not part of watching)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # megatron_cpu, next to this file


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--pp", type=int, default=2, help="pipeline-parallel size")
    ap.add_argument("--order", default="tp-cp-ep-dp-pp", help="Megatron's rank order (initialize_model_parallel)")
    ap.add_argument("--chunks", type=int, default=1, help="v, model chunks per pipeline rank (>1: interleaved 1F1B)")
    ap.add_argument("--microbatches", type=int, default=4, help="m, microbatches per step")
    ap.add_argument("--group-size", type=int, default=0, help="microbatch_group_size_per_vp_stage (default: pp)")
    ap.add_argument("--synthetic-ms", default="40,80", help="F,B: forward and backward ms per microbatch per chunk")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--layers-per-chunk", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--run-id", default="", help="default: a new id, shared by the ranks")
    ap.add_argument("--parwatch-log", default="", help="run directory for summaries.jsonl / spans.jsonl")
    ap.add_argument("--parwatch-endpoint", default="", help="sidecar URL (empty: none)")
    ap.add_argument("--parwatch-token-file", default="", help="file holding the sidecar's token")
    ap.add_argument("--no-parwatch", action="store_true", help="run the same training without parwatch")
    ap.add_argument(
        "--losses-out", default="", help="the last stage's first rank (of DP replica 0) writes its losses (JSON)"
    )
    ap.add_argument(
        "--batch-p2p", action="store_true", help="interleaved: batched p2p instead of overlapped (needs --pp >= 3)"
    )
    ap.add_argument("--checkpoint-dir", default="", help="per-rank checkpoints after every step (rollback)")
    ap.add_argument("--eval", action="store_true", help="after each step, a forward-only pass (unobserved)")
    ap.add_argument("--slow-stage", default="", help="PP_RANK:FACTOR: that stage's compute takes FACTOR times longer")
    ap.add_argument("--send-delay-ms", default="", help="PP_RANK:MS: that stage stalls MS before each activation send")
    injection.add_flags(ap)  # --inject SPEC, --pre-step-check on|off
    ap.add_argument("--hang-at", default="", help="RANK:STEP: that rank blocks in its forward at that step")
    ap.add_argument("--crash-at", default="", help="RANK:STEP: that rank exits hard in its forward at that step")
    args = ap.parse_args(argv)
    if min(args.tp, args.pp, args.chunks, args.microbatches, args.steps) < 1:
        ap.error("--tp, --pp, --chunks, --microbatches and --steps must be >= 1")
    try:
        args.fwd_ms, args.bwd_ms = (float(x) for x in args.synthetic_ms.split(","))
    except ValueError:
        ap.error(f"--synthetic-ms {args.synthetic_ms!r}: give F,B in ms, e.g. 40,80")
    if args.batch_p2p and args.chunks > 1 and args.pp < 3:
        ap.error("--batch-p2p with --chunks > 1 needs --pp >= 3 (Megatron 0.16 swaps tensors at pp=2)")
    args.slow = _stage_value(ap, "--slow-stage", args.slow_stage)
    args.hang = _stage_value(ap, "--hang-at", args.hang_at)  # a global rank, not a stage
    args.crash = _stage_value(ap, "--crash-at", args.crash_at)  # a global rank, not a stage
    args.send_delay = _stage_value(ap, "--send-delay-ms", args.send_delay_ms)
    args.faults = injection.parsed(ap, args)
    return args


def _stage_value(ap, flag: str, text: str):
    if not text:
        return None
    try:
        stage, value = text.split(":")
        return int(stage), float(value)
    except ValueError:
        ap.error(f"{flag} {text!r}: give PP_RANK:VALUE, e.g. 1:1.5")


FAULTS = {"factor": 1.0, "now": 0}
"""Injected faults (--inject, --hang-at) read by the loss and the stages' hooks: `factor` multiplies this
pass's loss (NaN, a spike's factor); `now`: the step being trained."""


def megatron_config(args):
    from megatron.core.transformer import TransformerConfig

    interleaved = args.chunks > 1
    return TransformerConfig(
        num_layers=args.layers_per_chunk * args.pp * args.chunks,
        hidden_size=args.hidden,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.chunks if interleaved else None,
        microbatch_group_size_per_vp_stage=(args.group_size or args.pp) if interleaved else None,
        # Interleaved at pp=2 with batched p2p, Megatron 0.16 swaps activations and gradients
        # between the two peers: overlapped unbatched p2p is what is correct there.
        batch_p2p_comm=not interleaved or args.batch_p2p,
        overlap_p2p_comm=interleaved and not args.batch_p2p,
        batch_p2p_sync=torch.cuda.is_available(),
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def build_model(args, config) -> list:
    """This rank's model chunks: GPTModel pieces for virtual stages chunk*pp + pp_rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    chunks = []
    for vp in range(args.chunks):
        vp_stage = vp if args.chunks > 1 else None
        torch.manual_seed(args.seed * 1000 + vp * 100 + ps.get_pipeline_model_parallel_rank())
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=args.vocab,
                max_sequence_length=args.seq,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=False,
                vp_stage=vp_stage,
            )
        )
    return chunks


def add_synthetic_compute(
    chunk, fwd_s: float, bwd_s: float, hang_step: int | None = None, crash_step: int | None = None
) -> None:
    """Sleep fwd_s before the chunk's forward and bwd_s when its backward starts (and, at
    `hang_step`, block for good before the forward: a hung rank, as the tests inject it; at
    `crash_step`, exit hard there: a crashed rank)."""

    def sleep_backward(grad):
        time.sleep(bwd_s)
        return grad

    def pre(module, inputs):
        time.sleep(fwd_s)
        if hang_step is not None and FAULTS["now"] == hang_step:
            print(f"injected hang at step {hang_step}, blocking at {time.time():.3f}", flush=True)
            time.sleep(3600)
        if crash_step is not None and FAULTS["now"] == crash_step:
            print(f"injected crash at step {crash_step}, exiting at {time.time():.3f}", flush=True)
            os._exit(17)

    def post(module, inputs, output):
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(sleep_backward)

    chunk.register_forward_pre_hook(pre)
    chunk.register_forward_hook(post)


def _delay_activation_sends(seconds: float) -> None:
    """This stage stalls before each activation send (a slow link, as the tests inject it): a fault
    injected into Megatron's P2PCommunicator class, in this process only."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    communicate = P2PCommunicator._communicate

    def delayed(self, *args, **kwargs):
        if kwargs.get("tensor_send_next") is not None:
            time.sleep(seconds)
        return communicate(self, *args, **kwargs)

    P2PCommunicator._communicate = delayed


def microbatches(args, step: int, dp_rank: int = 0) -> list[dict]:
    """This DP replica's microbatches of `step` (replica 0's are those of a run without DP)."""
    gen = torch.Generator().manual_seed(args.seed * 7919 + step + dp_rank * 1_000_003)
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), diagonal=1)[None, None]
    out = []
    for _ in range(args.microbatches):
        tokens = torch.randint(0, args.vocab, (args.microbatch_size, args.seq + 1), generator=gen)
        out.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "position_ids": torch.arange(args.seq).expand(args.microbatch_size, -1),
                "attention_mask": mask,
            }
        )
    return out


def loss_func(output_tensor):
    loss = output_tensor.float().mean()
    if FAULTS["factor"] != 1.0:
        loss = loss * FAULTS["factor"]
    return loss, {"lm loss": loss.detach().clone()}  # Megatron divides `loss` in place afterwards


def forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, loss_func


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    train(args)
    dist.barrier()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


def train(args) -> dict:
    """One run on this rank (the process group is up; Megatron's parallel state is set up here and
    torn down by the caller). Returns {"losses": {step: loss} of the surviving timeline, "history":
    [(step, loss)] of every step run (both on the last stage's ranks only), "applied": the directives
    handled}."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not torch.cuda.is_available():
        import megatron_cpu

        megatron_cpu.install()
    if dist.get_world_size() % (args.tp * args.pp):
        raise SystemExit(f"world size {dist.get_world_size()} is not a multiple of --tp {args.tp} x --pp {args.pp}")
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.chunks if args.chunks > 1 else None,
        order=args.order,
    )
    config = megatron_config(args)
    chunks = build_model(args, config)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    chunks = [chunk.to(device) for chunk in chunks]
    pp_rank, dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    factor = args.slow[1] if args.slow and args.slow[0] == pp_rank else 1.0
    hang_step = int(args.hang[1]) if args.hang and args.hang[0] == dist.get_rank() else None
    crash_step = int(args.crash[1]) if args.crash and args.crash[0] == dist.get_rank() else None
    if args.send_delay and args.send_delay[0] == pp_rank:
        _delay_activation_sends(args.send_delay[1] / 1000)
    for chunk in chunks:
        add_synthetic_compute(chunk, args.fwd_ms / 1000 * factor, args.bwd_ms / 1000 * factor, hang_step, crash_step)
    data_parallel = ps.get_data_parallel_world_size() > 1
    if data_parallel:  # Megatron's DDP: gradients in its buffers, all-reduced by finalize_model_grads
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        chunks = [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]
        config.finalize_model_grads_func = finalize_model_grads
    optimizer = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=args.lr)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    rank = dist.get_rank()

    def save(step: int) -> None:
        path = os.path.join(args.checkpoint_dir, f"step{step}-rank{rank}.pt")
        torch.save({"model": [c.state_dict() for c in chunks], "optimizer": optimizer.state_dict()}, path)

    def load_checkpoint(step):  # parwatch: rollback directives call this on every rank
        steps = sorted(
            int(f.split("-")[0][4:]) for f in os.listdir(args.checkpoint_dir) if f.endswith(f"-rank{rank}.pt")
        )
        target = step if step in steps else max([s for s in steps if step is None or s < step], default=None)
        if target is None:
            raise FileNotFoundError(f"no checkpoint at or before step {step} in {args.checkpoint_dir}")
        state = torch.load(os.path.join(args.checkpoint_dir, f"step{target}-rank{rank}.pt"))
        for chunk, sd in zip(chunks, state["model"]):
            chunk.load_state_dict(sd)
        optimizer.load_state_dict(state["optimizer"])
        return target

    watch = collector = None
    if not args.no_parwatch:
        from parwatch.collector import Collector, attach  # parwatch
        from parwatch.integrations import megatron as pw_megatron  # parwatch
        from parwatch.integrations import shared_run_id  # parwatch

        watch = pw_megatron.watch(  # parwatch
            chunks,
            config,
            run_id=args.run_id or shared_run_id(),  # one id, from rank 0
            microbatches=args.microbatches,
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
    forward_backward = get_forward_backward_func()  # after watch(): the watched schedule

    faults = injection.Faults(args.faults, rank, pp_rank)

    def run(step: int, forward_only: bool) -> list:
        data = [{k: t.to(device) for k, t in mb.items()} for mb in microbatches(args, step, dp_rank)]
        if data_parallel and not forward_only:
            for chunk in chunks:
                chunk.zero_grad_buffer()
        return forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=[iter(data) for _ in chunks] if len(chunks) > 1 else iter(data),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=args.microbatches,
            seq_length=args.seq,
            micro_batch_size=args.microbatch_size,
            forward_only=forward_only,
        )

    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
    losses: dict[int, float] = {}  # step -> loss of the surviving timeline
    history: list = []  # (step, loss) of every step run, rolled back or not
    step = watch.start() if watch else 0  # parwatch

    def train_step(trained: int, data_step: int, out: list) -> None:
        """One step's forward and backward on batch data_step (again, for a re-run), from zeroed gradients;
        `out` gets its microbatches' outputs."""
        optimizer.zero_grad()
        FAULTS["factor"] = faults.loss_factor(trained, data_step)
        out[:] = run(data_step, forward_only=False)
        if data_parallel:  # DDP keeps the (all-reduced) gradients in main_grad: the optimizer reads .grad
            for p in optimizer.param_groups[0]["params"]:
                p.grad = p.main_grad
        if faults.corrupt_grads_now(trained):
            next(p.grad for c in chunks for p in c.parameters() if p.grad is not None).view(-1)[0] = float("nan")

    while step < args.steps:
        trained = step + 1
        data_step = trained + (watch.data_offset if watch else 0)  # parwatch: batches rollbacks skipped
        FAULTS["now"] = trained
        out: list = []
        train_step(trained, data_step, out)
        if watch:  # parwatch: the check (a bad step re-run or skipped), then optimizer.step()
            watch.optimizer_step(optimizer, rerun=partial(train_step, trained, data_step, out))
        else:
            optimizer.step()
        if last:
            losses[trained] = float(torch.stack([d["lm loss"] for d in out]).mean())
            history.append((trained, losses[trained]))
        # parwatch: the step boundary; may pause or roll back (after the last step, once the last steps are judged)
        step = watch.step_done(last=trained == args.steps) if watch else trained
        if step != trained:  # rolled back: the steps after the loaded one are gone
            losses = {s: v for s, v in losses.items() if s <= step}
        elif args.checkpoint_dir:
            with watch.checkpoint() if watch else nullcontext():  # parwatch: the save, timed (not bubble)
                save(step)
            if watch:
                watch.checkpoint_saved(step)  # parwatch
        if args.eval:
            with torch.no_grad():
                run(10_000 + step, forward_only=True)  # evaluation: not a training step, no boundary
    if watch:
        watch.close()  # parwatch
        collector.close()  # parwatch
    if args.losses_out and last and ps.get_tensor_model_parallel_rank() == 0 and dp_rank == 0:
        with open(args.losses_out, "w") as f:
            json.dump({str(s): repr(v) for s, v in sorted(losses.items())}, f)
    return {
        "losses": losses if last else {},
        "history": history if last else [],
        "applied": watch.applied if watch else [],
    }


def _token(args):
    """--parwatch-token-file, else $PARWATCH_TOKEN, else None."""
    from parwatch.tokens import read_token

    return read_token(args.parwatch_token_file, flag="--parwatch-token-file")


if __name__ == "__main__":
    sys.exit(main())
