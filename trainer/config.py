"""The trainer's configuration: one dataclass, fed by the command line, the tests and run_info.

Imports no torch: `parwatch train --nproc N` parses it in a launcher that only spawns the ranks."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field

from parwatch.trainer.errors import ConfigError
from parwatch.trainer.faults import EXAMPLE as FAULT_EXAMPLES
from parwatch.trainer.faults import parse_fault
from parwatch.trainer.schedules import SCHEDULE_CHOICES, SCHEDULES
from parwatch.vocabulary import ScheduleName

CHOICES = {"schedule": SCHEDULE_CHOICES, "parwatch": ("on", "off", "auto"), "pre_step_check": ("on", "off")}
"""The settings that take one of a few values: what their flag accepts."""


@dataclass(frozen=True)
class SyntheticCompute:
    fwd_ms: float
    """Forward time per microbatch per stage."""
    bwd_ms: float
    """Backward time per microbatch per stage."""
    serial_tp: float = 0.0
    """1: the TP collectives add to fwd_ms/bwd_ms, on the critical path as real TP layers' are (a rank that
    waits for a late TP peer computes no less for it); 0: they overlap the sleep (a forward takes exactly
    fwd_ms whatever the machine's load, which the bubble checks need)."""


def parse_synthetic(spec: str | None) -> SyntheticCompute | None:
    if not spec:
        return None
    values = {}
    for item in spec.split(","):
        key, eq, value = item.partition("=")
        if key not in ("fwd_ms", "bwd_ms", "serial_tp") or not eq:
            raise ConfigError(
                f"--synthetic-compute {spec!r}: expected fwd_ms=N,bwd_ms=N[,serial_tp=1] (e.g. fwd_ms=10,bwd_ms=20)"
            )
        try:
            values[key] = float(value)
        except ValueError:
            raise ConfigError(f"--synthetic-compute {spec!r}: {key}={value!r} is not a number") from None
    if not {"fwd_ms", "bwd_ms"} <= set(values) or min(values.values()) < 0 or values.get("serial_tp", 0) not in (0, 1):
        raise ConfigError(f"--synthetic-compute {spec!r}: give both fwd_ms and bwd_ms, >= 0 (e.g. fwd_ms=10,bwd_ms=20)")
    return SyntheticCompute(**values)


@dataclass
class TrainConfig:
    nproc: int = 0
    """Ranks to spawn on this machine; 0 means: take the world from torchrun's env (or run alone)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline stages."""
    dp: int = 1
    """Data-parallel replicas."""
    schedule: str = ScheduleName.ONE_F_ONE_B.value
    """gpipe, 1f1b or interleaved1f1b (alias: interleaved)."""
    chunks: int = 1
    """Model chunks per stage (v); >= 2 only with --schedule interleaved1f1b."""
    microbatches: int = 4
    """Microbatches per step per DP replica (m)."""
    micro_batch_size: int = 2
    """Sequences per microbatch (b)."""
    steps: int = 20
    """Optimizer steps to complete."""
    seed: int = 0
    """Seeds weights and data; same seed, same losses on any layout."""
    layers: int = 4
    """Transformer blocks (at least pp * chunks)."""
    hidden: int = 64
    """Model width; divisible by --heads."""
    heads: int = 4
    """Attention heads; divisible by --tp."""
    vocab: int = 64
    """Vocabulary size; divisible by --tp."""
    seq_len: int = 32
    """Tokens per sequence."""
    lr: float = 3e-3
    """Learning rate."""
    optimizer: str = "adamw"
    """adamw or sgd."""
    dtype: str = "float32"
    """float32 or float64 (float64 for exactness checks)."""
    partition: str = "uniform"
    """uniform (blocks per stage) or parameters (balanced parameter counts)."""
    checkpoint_dir: str = ""
    """Where checkpoints go; empty means none."""
    checkpoint_every: int = 0
    """Save every N steps; 0 means never."""
    resume: bool = False
    """At start, load this run's newest checkpoint in --checkpoint-dir that every rank verifies (a restart
    after a crash, e.g. under torchrun --max-restarts, with the same --run-id); none: start at step 0."""
    keep_checkpoints: int = 3
    """Complete checkpoints to keep; 0 keeps all."""
    inject: list = field(default_factory=list)
    """Fault specs (see parwatch.trainer.faults)."""
    pre_step_check: str = "on"
    """on: before each optimizer step one small all-reduce of every rank's loss and gradient finiteness; a
    bad step is re-run, skipped or paused on every rank (parwatch.contract.step_check); off: every update
    goes in (the sidecar's rules act after the fact)."""
    synthetic_compute: str = ""
    """fwd_ms=N,bwd_ms=N: replace layer math with sleeps; empty means real compute."""
    summary_json: str = ""
    """Rank 0 writes the run summary here; empty means don't."""
    backend: str = "auto"
    """gloo, nccl, or auto (nccl when CUDA is available)."""
    timeout_s: float = 300.0
    """Collective timeout: a dead peer fails the run after this long instead of hanging it."""
    pause_poll_s: float = 0.5
    """While paused, ranks exchange a heartbeat collective this often."""
    run_id: str = ""
    """Names the run in metrics and logs; empty means generated."""
    parwatch: str = "auto"
    """on: attach parwatch's collector (this rank's spans -> sidecar); off: nothing registered;
    auto: on when --parwatch-endpoint or --parwatch-log is given, else off."""
    parwatch_endpoint: str = ""
    """Sidecar control/ingest URL, e.g. http://127.0.0.1:9401."""
    parwatch_token_file: str = ""
    """File holding the sidecar's bearer token (else $PARWATCH_TOKEN)."""
    parwatch_peak_flops: float = 0.0
    """Accelerator peak FLOP/s at the run's dtype, for MFU; 0 means unknown (no MFU reported)."""
    parwatch_log: str = ""
    """Collector JSONL output directory (summaries.jsonl, spans.jsonl); empty means none."""

    def validate(self, world_size: int | None = None) -> None:
        """Raise ConfigError naming the setting and the fix; the world check needs world_size."""
        if self.schedule not in SCHEDULE_CHOICES:
            raise ConfigError(f"--schedule={self.schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
        for name in (
            "tp",
            "pp",
            "dp",
            "micro_batch_size",
            "steps",
            "layers",
            "hidden",
            "heads",
            "vocab",
            "seq_len",
            "chunks",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}={getattr(self, name)} must be at least 1")
        if self.microbatches < 1:
            raise ConfigError(
                f"--microbatches={self.microbatches} must be at least 1; a pipeline needs work to fill it"
            )
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume loads a checkpoint: give --checkpoint-dir (where the run saved them)")
        if self.heads % self.tp:
            ok = [t for t in range(1, self.heads + 1) if self.heads % t == 0]
            raise ConfigError(
                f"--heads={self.heads} is not divisible by --tp={self.tp}; choose tp in {ok} or change --heads"
            )
        if self.hidden % self.heads:
            raise ConfigError(
                f"--hidden={self.hidden} is not divisible by --heads={self.heads}; choose a multiple of {self.heads}"
            )
        if self.vocab % self.tp:
            raise ConfigError(
                f"--vocab={self.vocab} is not divisible by --tp={self.tp}; choose a multiple of {self.tp}"
            )
        if self.layers < self.pp * self.chunks:
            raise ConfigError(
                f"--layers={self.layers} is fewer than pp*chunks={self.pp * self.chunks} pipeline chunks; "
                f"raise --layers to {self.pp * self.chunks} or lower --pp"
            )
        if self.partition not in ("uniform", "parameters"):
            raise ConfigError(f"--partition={self.partition!r} is unknown; choose 'uniform' or 'parameters'")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"--backend={self.backend!r} is unknown; choose auto, gloo or nccl")
        for name, zero in (("checkpoint_every", "never saves"), ("keep_checkpoints", "keeps all")):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 0 (0 {zero})")
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"--optimizer={self.optimizer!r}; choose adamw or sgd")
        if self.dtype not in ("float32", "float64"):
            raise ConfigError(f"--dtype={self.dtype!r}; choose float32 or float64")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir DIR")
        if self.parwatch_peak_flops < 0:
            raise ConfigError(f"--parwatch-peak-flops={self.parwatch_peak_flops} must be >= 0 (0: unknown, no MFU)")
        if self.pre_step_check not in ("on", "off"):
            raise ConfigError(f"--pre-step-check={self.pre_step_check!r}; choose on or off")
        if self.parwatch not in ("on", "off", "auto"):
            raise ConfigError(f"--parwatch={self.parwatch!r}; choose on, off or auto")
        if self.parwatch == "off" and (self.parwatch_endpoint or self.parwatch_log):
            given = "--parwatch-endpoint" if self.parwatch_endpoint else "--parwatch-log"
            raise ConfigError(
                f"{given} is given but --parwatch=off watches nothing; drop --parwatch off "
                f"(an endpoint or log implies on) or drop {given}"
            )
        for spec in self.inject:
            parse_fault(spec)
        parse_synthetic(self.synthetic_compute)
        from parwatch.trainer.schedules import build_schedule  # its argument checks name the fix

        build_schedule(self.schedule, 0, self.pp, self.microbatches, self.chunks)
        if world_size is not None:
            from parwatch.trainer.parallel_dims import ParallelDims

            ParallelDims(self.tp, self.pp, self.dp, world_size)

    @property
    def watched(self) -> bool:
        """Whether parwatch's collector is attached (see --parwatch)."""
        return self.parwatch == "on" or (self.parwatch == "auto" and bool(self.parwatch_endpoint or self.parwatch_log))

    @property
    def tokens_per_step(self) -> int:
        return self.dp * self.microbatches * self.micro_batch_size * self.seq_len

    def to_dict(self) -> dict:
        return asdict(self)


def field_docs() -> dict[str, str]:
    """The one-line docstring under each TrainConfig field, for --help."""
    import ast
    import inspect

    cls = ast.parse(inspect.getsource(TrainConfig)).body[0]
    assert isinstance(cls, ast.ClassDef)
    body = cls.body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line naming the flag, like every other configuration error."""

    def error(self, message):
        self.exit(2, f"error: {message} (see python -m parwatch.trainer --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="python -m parwatch.trainer",
        description="Reference TP+PP trainer (gloo on CPU, NCCL on GPU).",
        epilog="example: python -m parwatch.trainer --nproc 4 --tp 2 --pp 2 --schedule 1f1b --microbatches 4 --steps 20",
    )
    defaults = TrainConfig()
    docs = field_docs()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if name == "inject":
            p.add_argument(
                flag,
                action="append",
                default=[],
                metavar="SPEC",
                help=f"fault to inject, repeatable: {FAULT_EXAMPLES}",
            )
        elif isinstance(value, bool):
            p.add_argument(flag, action="store_true", help=docs.get(name))
        else:
            kwargs = {"type": type(value), "default": value, "help": f"{docs.get(name, '')} (default: %(default)s)"}
            if name in CHOICES:
                kwargs["choices"] = CHOICES[name]
            p.add_argument(flag, **kwargs)
    return p


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    ns = build_parser().parse_args(argv)
    return TrainConfig(**vars(ns))
