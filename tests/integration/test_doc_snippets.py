"""The docs' snippets run as written: every python block of README.md and docs/{torch_pipelining,megatron,
deepspeed}.md marked `<!-- doc-snippet: NAME ... -->` runs on 2 real gloo ranks against a real sidecar.

A snippet shows the lines a user adds to their own training; what it calls "as before" (the schedule and its
stages, the model chunks, the engine, an optimizer, data, save and load) comes from the prelude named NAME
below, built from the examples/. The snippet's text is executed unchanged, but for the sidecar's URL: the
docs say the default `http://127.0.0.1:9401`, the test's sidecar listens on a free port. The ranks run in a
directory where the sidecar keeps its state in `parwatch-state` (so its token is where the snippets read it)
and each run's spans land in run/spans.jsonl (the report's timeline): the sidecar has every step of the run,
and the spans hold the run's checkpoint saves."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests import one_client
from tests.distutil import ROOT, load_example, run_ranks
from tests.sidecar_process import running_sidecar

pytestmark = pytest.mark.integration

DOCS = ("README.md", "docs/torch_pipelining.md", "docs/megatron.md", "docs/deepspeed.md")
MARK = re.compile(r"<!-- doc-snippet: (\w+) [^>]*-->\n```python\n(.*?)\n```", re.S)
DEFAULT_ENDPOINT = "http://127.0.0.1:9401"
STEPS, CHECKPOINT_EVERY = 3, 2  # the save after step 2 is timed in step 3, whose boundary ends it


def snippets() -> list[tuple[str, str, str]]:
    """(doc:line, prelude name, code) of every marked block."""
    out = []
    for doc in DOCS:
        text = (Path(ROOT) / doc).read_text()
        for m in MARK.finditer(text):
            out.append((f"{doc}:{text[: m.start()].count(chr(10)) + 1}", m.group(1), m.group(2)))
    return out


# --- preludes: what the snippets call "as before" ----------------------------------------------


def _save_load(modules, optimizer, rank):
    import torch

    def save(step):
        os.makedirs("run/ckpt", exist_ok=True)
        state = {"model": [m.state_dict() for m in modules], "optimizer": optimizer.state_dict()}
        torch.save(state, f"run/ckpt/step{step}-rank{rank}.pt")

    def load(step):
        saved = sorted(int(f.split("-")[0][4:]) for f in os.listdir("run/ckpt") if f.endswith(f"-rank{rank}.pt"))
        target = max(s for s in saved if step is None or s <= step)
        state = torch.load(f"run/ckpt/step{target}-rank{rank}.pt")
        for m, sd in zip(modules, state["model"]):
            m.load_state_dict(sd)
        optimizer.load_state_dict(state["optimizer"])
        return target

    return save, load


def torch_pipelining(rank, world, run_id) -> dict:
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    ex = load_example("torch_pipelining")
    args = ex.parse_args(
        ["--schedule", "interleaved1f1b", "--chunks", "2", "--microbatches", "8", "--synthetic-ms", "1,2"]
    )
    schedule, modules, optimizer = ex.build(args, rank, world)
    x, y = ex.batch(args, 1)
    save, load = _save_load(modules, optimizer, rank)

    def batch(step):  # the user's data: the example's batch of a step, where each end of the pipeline needs it
        x, y = ex.batch(args, step)
        return (x if rank == 0 else None), (y if rank == world - 1 else None)

    return {
        "ScheduleInterleaved1F1B": ScheduleInterleaved1F1B,
        "stages": schedule._stages,
        "loss_fn": schedule._loss_fn,
        "schedule": schedule,
        "optimizer": optimizer,
        "x": x if rank == 0 else None,
        "y": y if rank == world - 1 else None,
        "batch": batch,
        "steps": STEPS,
        "checkpoint_every": CHECKPOINT_EVERY,
        "save": save,
        "load": load,
    }


def megatron(rank, world, run_id, cpu_code: str) -> dict:
    import torch
    from megatron.core import parallel_state

    ex = load_example("megatron_gpt")
    args = ex.parse_args(["--pp", str(world), "--microbatches", "4", "--synthetic-ms", "0,0"])
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world)
    exec(compile(cpu_code, "docs/megatron.md (megatron_cpu)", "exec"), {"seed": args.seed})
    config = ex.megatron_config(args)
    model_chunks = ex.build_model(args, config)
    optimizer = torch.optim.SGD([p for c in model_chunks for p in c.parameters()], lr=args.lr)
    save, load = _save_load(model_chunks, optimizer, rank)
    data = itertools.chain.from_iterable(ex.microbatches(args, step) for step in range(1, STEPS + 1))

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step_func(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        return output, loss_func

    return {
        "model_chunks": model_chunks,
        "config": config,
        "run_id": run_id,
        "m": args.microbatches,
        "s": args.seq,
        "b": args.microbatch_size,
        "forward_step_func": forward_step_func,
        "data_iterator": data,
        "microbatches": lambda step: ex.microbatches(args, step),  # the user's data: a step's microbatches
        "optimizer": optimizer,
        "steps": STEPS,
        "checkpoint_every": CHECKPOINT_EVERY,
        "save": save,
        "load": load,
    }


def deepspeed(rank, world, run_id) -> dict:
    import logging

    import deepspeed as ds
    import torch
    import torch.nn.functional as F
    from deepspeed.pipe import LayerSpec, PipelineModule

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds.init_distributed(dist_backend="gloo", verbose=False)  # adopts the group run_ranks made
    ex = load_example("deepspeed_pipe")
    args = ex.parse_args(["--pp", str(world), "--microbatches", "4", "--synthetic-ms", "0,0"])
    layers = [LayerSpec(ex.SyntheticStage, args.hidden, 0.0, 0.0, s) for s in range(world)]
    module = PipelineModule(layers=layers, num_stages=world, loss_fn=F.mse_loss, partition_method="uniform")
    batches = ex.Batches(args)

    def my_data_from(step):
        batches.seek(step)
        return batches

    return {
        "pipeline_module": module,
        "opt": torch.optim.SGD(module.parameters(), lr=args.lr),
        "cfg": {
            "train_micro_batch_size_per_gpu": args.microbatch_size,
            "gradient_accumulation_steps": args.microbatches,
            "steps_per_print": 10**9,
        },
        "run_id": run_id,
        "steps": STEPS,
        "data_iter": batches,
        "my_data_from": my_data_from,
    }


def run_block(rank: int, world: int, where: str, prelude: str, code: str, endpoint: str, workdir: str, cpu: str):
    """Every rank: the prelude's names, then the snippet as written (its default endpoint the test sidecar's)."""
    import torch.distributed as dist

    os.chdir(workdir)
    run_id = f"doc-{prelude}-{os.path.basename(workdir)}"  # the snippets that take one: the same on every rank
    names = megatron(rank, world, run_id, cpu) if prelude == "megatron" else globals()[prelude](rank, world, run_id)
    try:
        exec(compile(code.replace(DEFAULT_ENDPOINT, endpoint), where, "exec"), names)
    finally:
        if prelude == "megatron":
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
    dist.barrier()
    return True


BLOCKS = snippets()


def test_the_marked_blocks_are_the_four_usage_snippets_and_the_cpu_shim():
    assert [(where.split(":")[0], name) for where, name, _ in BLOCKS] == [
        ("README.md", "torch_pipelining"),
        ("docs/torch_pipelining.md", "torch_pipelining"),
        ("docs/megatron.md", "megatron"),
        ("docs/megatron.md", "megatron_cpu"),
        ("docs/deepspeed.md", "deepspeed"),
    ]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("where,prelude,code", [b for b in BLOCKS if b[1] != "megatron_cpu"], ids=lambda v: v)
def test_a_doc_snippet_runs_as_written_with_a_real_sidecar(tmp_path, where, prelude, code):
    if prelude in ("megatron", "deepspeed"):
        pytest.importorskip(prelude)
    cpu = next(c for _, name, c in BLOCKS if name == "megatron_cpu")
    with running_sidecar(tmp_path / "parwatch-state", "--rank-grace-seconds", "5") as sidecar:
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        run_ranks(run_block, 2, where, prelude, code, sidecar.control_url, str(tmp_path), cpu, timeout=500)
        status = one_client.get(f"{sidecar.control_url}/v1/status", headers=sidecar.headers, timeout=10).json()
    spans = [json.loads(line) for line in (tmp_path / "run" / "spans.jsonl").read_text().splitlines()]
    run_ids = {s["run_id"] for s in spans}
    assert len(run_ids) == 1 and status["run"]["run_id"] in run_ids, (run_ids, status["run"])
    assert status["last_step"] == STEPS and {r["last_step"] for r in status["ranks"].values()} == {STEPS}, status
    assert {s["rank"] for s in spans} == {0, 1}
    assert any(s["kind"] == "checkpoint" for s in spans) or prelude == "deepspeed" and "save_checkpoint" not in code
