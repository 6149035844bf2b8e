"""Putting a Collector on the trainer's hook registry, by hand or from the trainer's config.

A rank sends only its own credential (parwatch/credentials.py), minted where the secret already is:
- `parwatch train --nproc N` (the launcher spawns the ranks): `RankAttach.prepare` mints every rank's
  credential in the launcher and hands each spawned rank its own; the ranks get neither the token file's
  path nor $PARWATCH_TOKEN;
- under torchrun (one environment for every worker of a node): each worker mints its own from
  $PARWATCH_RUN_KEY (the run's key, which a job script makes with `parwatch credential --run-id ID`) or,
  without one, from the token ($PARWATCH_TOKEN or --parwatch-token-file), and drops both variables from its
  environment before training starts; its collector keeps the credential alone.
"""

from __future__ import annotations

import os

from parwatch import credentials
from parwatch.collector.collector import Collector
from parwatch.collector.context import RunContext
from parwatch.collector.shipper import Unauthorized
from parwatch.contract import HookRegistry, PerfCounterClock
from parwatch.contract import registry as default_registry
from parwatch.tokens import TOKEN_ENV, TokenError
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


def _secret(cfg) -> str | None:
    """What a rank's credential is minted from: the run's key, else the token (file, else environment)."""
    try:
        return credentials.from_environment() or read_token(cfg.parwatch_token_file)
    finally:
        for name in (TOKEN_ENV, credentials.RUN_KEY_ENV):  # the rank keeps its credential alone
            os.environ.pop(name, None)


def attach_from_config(
    cfg, rank: int, world_size: int, local_rank: int, backend: str, credential: str | None = None
) -> Collector:
    """The bundled trainer's way in: a Collector for this rank from its TrainConfig, attached.

    cfg.parwatch_endpoint: sidecar URL ("" ships nothing); cfg.parwatch_log: run directory for
    summaries.jsonl and spans.jsonl, shared by the ranks ("" writes none). NVML and the CUDA
    clock are used only when the backend is NCCL (this rank then owns GPU `local_rank`).
    credential: this rank's own, minted by the launcher; None: minted here from the run's key or the token.
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
    try:
        token = credential or (_secret(cfg) if cfg.parwatch_endpoint else None)
        token = credentials.for_rank(token, cfg.run_id, rank) if token else None
    except credentials.CredentialError as err:
        raise AttachError(str(err)) from None
    return attach(
        Collector(
            ctx,
            endpoint=cfg.parwatch_endpoint or None,
            token=token,
            log_path=os.path.join(log_dir, "summaries.jsonl") if log_dir else None,
            spans_path=os.path.join(log_dir, "spans.jsonl") if log_dir else None,
            peak_flops=getattr(cfg, "parwatch_peak_flops", 0.0) or None,
        )
    )


class RankAttach:
    """`parwatch train`'s attach (the trainer's launcher calls it, parwatch.trainer.launch.Attach): a collector
    per rank, with that rank's own credential. Picklable: spawned ranks receive theirs from the launcher."""

    def __init__(self, credential: str | None = None):
        self.credential = credential

    def __call__(self, cfg, rank: int, world_size: int, local_rank: int, backend: str) -> Collector:
        return attach_from_config(cfg, rank, world_size, local_rank, backend, credential=self.credential)

    def prepare(self, cfg, world_size: int) -> list[RankAttach]:
        """In the launcher, before it spawns `world_size` ranks of run cfg.run_id: mint each rank's credential
        here, where the secret is, and give each rank its own alone; the ranks inherit neither the token
        file's path (cleared in `cfg`) nor $PARWATCH_TOKEN / $PARWATCH_RUN_KEY."""
        if not cfg.parwatch_endpoint:
            return [self] * world_size
        try:
            secret = _secret(cfg)
            minted = [credentials.for_rank(secret, cfg.run_id, r) if secret else None for r in range(world_size)]
        except credentials.CredentialError as err:
            raise AttachError(str(err)) from None
        cfg.parwatch_token_file = ""
        return [RankAttach(c) for c in minted]
