"""Putting a Collector on the trainer's hook registry, by hand or from the trainer's config."""

from __future__ import annotations

import os

from parwatch.collector.collector import Collector
from parwatch.collector.context import RunContext
from parwatch.collector.shipper import Unauthorized
from parwatch.contract import HookRegistry, PerfCounterClock
from parwatch.contract import registry as default_registry
from parwatch.tokens import TokenError
from parwatch.tokens import read_token as read


class AttachError(ValueError):
    """A collector cannot be attached as configured; the message names the setting and the fix."""


def attach(collector: Collector, registry: HookRegistry | None = None) -> Collector:
    """Register the collector on the trainer's hook registry and install its clock.

    With a sidecar endpoint, first asks it once whether it takes the collector's token: a refusal
    closes the collector and raises AttachError naming the fix, before training starts (a run that
    started anyway would drop every summary). A sidecar that does not answer yet is no error."""
    try:
        collector.shipper.check_token()
    except Unauthorized as err:
        collector.close(timeout=0.5)
        raise AttachError(str(err)) from None
    registry = default_registry if registry is None else registry
    registry.register(collector)
    registry.clock = collector.clock
    collector._registry = registry
    collector.activity.registry = registry  # the activity thread reads registry.current
    return collector


def detach(collector: Collector) -> None:
    """Undo `attach`: unregister, and give the registry back a host clock if it had ours."""
    registry = collector._registry
    if registry is None:
        return
    if collector in registry.observers:
        registry.unregister(collector)
    if registry.clock is collector.clock:
        registry.clock = PerfCounterClock()
    collector._registry = None


def read_token(path: str) -> str | None:
    """--parwatch-token-file, else $PARWATCH_TOKEN, else None; a bad file is an AttachError."""
    try:
        return read(path, flag="--parwatch-token-file")
    except TokenError as err:
        raise AttachError(str(err)) from None


def attach_from_config(cfg, rank: int, world_size: int, local_rank: int, backend: str) -> Collector:
    """The bundled trainer's way in: a Collector for this rank from its TrainConfig, attached.

    cfg.parwatch_endpoint: sidecar URL ("" ships nothing); cfg.parwatch_log: run directory for
    summaries.jsonl and spans.jsonl, shared by the ranks ("" writes none). NVML and the CUDA
    clock are used only when the backend is NCCL (this rank then owns GPU `local_rank`).
    """
    ctx = RunContext.for_rank(
        cfg.run_id,
        rank,
        tp=cfg.tp,
        pp=cfg.pp,
        dp=cfg.dp,
        schedule=cfg.schedule,
        microbatches=cfg.microbatches,
        chunks=cfg.chunks,
        tokens_per_step=cfg.tokens_per_step,
        local_gpu=local_rank if backend == "nccl" else None,
    )
    if ctx.world_size != world_size:
        raise AttachError(f"tp*pp*dp = {ctx.world_size} but the world has {world_size} ranks; fix --tp/--pp/--dp")
    log_dir = cfg.parwatch_log
    return attach(
        Collector(
            ctx,
            endpoint=cfg.parwatch_endpoint or None,
            token=read_token(cfg.parwatch_token_file),
            log_path=os.path.join(log_dir, "summaries.jsonl") if log_dir else None,
            spans_path=os.path.join(log_dir, "spans.jsonl") if log_dir else None,
            peak_flops=getattr(cfg, "parwatch_peak_flops", 0.0) or None,
        )
    )
