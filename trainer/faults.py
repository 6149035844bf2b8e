"""Fault injection: `--inject KIND:key=value,...`, repeatable.

straggler:stage=1,ms=30[,from_step=3]   extra time per microbatch forward on that stage
straggler:rank=0,ms=30                  ... on that rank only (stage and rank together: both must match)
nan:step=5                              the loss of that step becomes NaN (once per process:
                                        a transient fault; a re-run or a rollback that replays step 5 is clean)
bad-batch:step=5                        the batch step 5 trains on (data step 5) gives a NaN loss every
                                        time it is computed: a re-run, or a rollback that does not skip
                                        it, meets it again
sdc:rank=1,step=5                       rank 1's gradients are corrupted once at step 5, after its
                                        backward (one element becomes NaN: silent data corruption)
loss-spike:step=5[,factor=10]           the loss of step 5 is multiplied by factor (default 10), once
                                        per process: its gradients too, as a bad batch of the moment would
slow-collective:group=tp,ms=5           extra latency on every collective of that group
crash:rank=2,step=7                     that rank exits hard (os._exit) at that step
raise:rank=2,step=7                     that rank raises InjectedError at that step (a crash by
                                        exception: OOM, bad data, a library's error)
slow-link:src=0,dst=2,ms=20             every p2p send from rank 0 to rank 2 takes 20 ms longer: posted
                                        on time, it leaves 20 ms later (inside the transfer, as a slow
                                        link would be; not a sleep before the post)
slow-data:rank=0,ms=15                  every data fetch of rank 0 takes 15 ms longer (only the first
                                        and last pipeline stages fetch data)
hang:rank=1,step=5[,where=compute]      that rank blocks forever at that step, process alive:
                                        where=compute inside its first forward, where=collective
                                        before its first TP all-reduce (needs tp >= 2), where=send
                                        before its first p2p send (needs pp >= 2); the fault
                                        campaign's places are below

The fault campaign's kinds (benchmarks/fault_campaign.py; one block, kept apart for merges):
hang:rank=1,step=5,where=backward       ... inside its first backward
hang:rank=1,step=5,where=recv           ... inside its first p2p receive of the step, before taking
                                        the data its peer sent (needs pp >= 2)
hang:rank=1,step=5,where=boundary       ... before joining the step's boundary all-reduce (between spans)
hang:rank=0,step=5,where=kernel         on CUDA, a kernel that never ends inside its first forward
                                        (torch.cuda._sleep): the host goes on until it waits for the
                                        device; without CUDA it blocks there like where=compute
slow-checkpoint:ms=500                  every checkpoint save takes 500 ms longer (inside its span;
                                        needs --checkpoint-every)
eval-pause:every=10,ms=2000             every 10 steps, after the boundary, every rank runs a 2 s eval
                                        pass (an `eval` span): a healthy pause between steps
warmup:ms=4000                          the first step takes 4 s longer on every rank (compilation,
                                        allocator warm-up): inside its first forward
hiccup:rank=1,step=5,ms=1500[,how=stop] that rank stops for 1.5 s at that step, then goes on: how=stop
                                        stops the whole process (SIGSTOP, all threads: a host hiccup);
                                        how=sleep only its training thread (a long GC pause)
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

from parwatch.trainer.errors import ConfigError
from parwatch.vocabulary import GroupRole

_SPECS: dict[str, dict[str, type[int | float | str]]] = {
    "straggler": {"stage": int, "ms": float, "from_step": int, "rank": int},
    "nan": {"step": int},
    "bad-batch": {"step": int},
    "sdc": {"rank": int, "step": int},
    "loss-spike": {"step": int, "factor": float},
    "slow-collective": {"group": str, "ms": float},
    "crash": {"rank": int, "step": int},
    "raise": {"rank": int, "step": int},
    "slow-link": {"src": int, "dst": int, "ms": float},
    "slow-data": {"rank": int, "ms": float},
    "hang": {"rank": int, "step": int, "where": str},
}
_OPTIONAL = {"straggler": {"stage", "from_step", "rank"}, "hang": {"where"}, "loss-spike": {"factor"}}
"""Every other key of a fault's spec is required."""
_EXAMPLE = (
    "straggler:stage=1,ms=30,from_step=3 | nan:step=5 | bad-batch:step=5 | sdc:rank=1,step=5 | loss-spike:step=5,factor=10"
    " | slow-collective:group=tp,ms=5 | crash:rank=2,step=7 | slow-link:src=0,dst=2,ms=20 | slow-data:rank=0,ms=15"
    " | hang:rank=1,step=5,where=collective"
)
EXAMPLE = _EXAMPLE
"""Every kind with an example, for --help."""
SPIKE_FACTOR = 10.0
"""A loss-spike fault's default factor: far above the check's 3x (StepPolicy.spike_factor)."""
HANG_PLACES: tuple[str, ...] = ("compute", "collective", "send")
"""Where a hang fault blocks: inside a forward, before a TP all-reduce, before a p2p send."""

# ----------------------------------------------------------------- the fault campaign's kinds (issue 44)
_SPECS.update(
    {
        "slow-checkpoint": {"ms": float},
        "eval-pause": {"every": int, "ms": float},
        "warmup": {"ms": float},
        "hiccup": {"rank": int, "step": int, "ms": float, "how": str},
    }
)
_OPTIONAL.update({"hiccup": {"how"}})
HANG_PLACES += ("backward", "recv", "boundary", "kernel")
HICCUPS = ("stop", "sleep")
"""How a hiccup stops its rank: the whole process (SIGSTOP, resumed by a helper), or the training thread."""
_EXAMPLE += (
    " | hang:rank=1,step=5,where=recv | slow-checkpoint:ms=500 | eval-pause:every=10,ms=2000 | warmup:ms=4000"
    " | hiccup:rank=1,step=5,ms=1500,how=stop"
)
EXAMPLE = _EXAMPLE


def _check_campaign_fault(spec: str, kind: str, params: dict[str, Any]) -> None:
    """The campaign kinds' own checks (parse_fault calls this for every kind)."""
    for key in ("ms", "every", "rank", "step"):
        if (
            kind in ("slow-checkpoint", "eval-pause", "warmup", "hiccup")
            and key in params
            and params[key] < (key == "every")
        ):
            raise ConfigError(f"--inject {spec!r}: {key} must be >= {int(key == 'every')}")
    if kind == "hiccup":
        params.setdefault("how", "stop")
        if params["how"] not in HICCUPS:
            raise ConfigError(f"--inject {spec!r}: how={params['how']!r} is not one of {', '.join(HICCUPS)}")


def add_flags(parser) -> None:
    """`--inject SPEC` (repeatable) and `--pre-step-check on|off` on an argparse parser: the examples'
    faults in this module's syntax, and whether the trainer runs the check before the optimizer step."""
    parser.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="a fault, repeatable, in the reference trainer's syntax: nan:step=S | bad-batch:step=S | "
        "sdc:rank=R,step=S | loss-spike:step=S[,factor=F] (parwatch.trainer.faults)",
    )
    parser.add_argument(
        "--pre-step-check",
        choices=("on", "off"),
        default="on",
        help="the check before the optimizer step (on: a bad step is re-run, skipped or paused)",
    )


def parsed(parser, args) -> list[Fault]:
    """The faults of `args.inject` (add_flags), or the parser's one-line error naming the bad spec."""
    try:
        return [parse_fault(spec) for spec in args.inject]
    except ConfigError as err:
        parser.error(str(err))
        raise  # parser.error exits


class InjectedError(Exception):
    """What a `raise` fault raises: an exception the trainer does not expect."""


@dataclass(frozen=True)
class Fault:
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    """The spec's key=value pairs, each of its key's type (_SPECS)."""


def parse_fault(spec: str) -> Fault:
    kind, _, rest = spec.partition(":")
    if kind not in _SPECS:
        raise ConfigError(f"--inject {spec!r}: unknown fault {kind!r}; use one of: {_EXAMPLE}")
    params: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in _SPECS[kind]:
            raise ConfigError(
                f"--inject {spec!r}: {kind} takes {', '.join(k + '=' for k in _SPECS[kind])} (got {item!r}); e.g. {_EXAMPLE}"
            )
        try:
            params[key] = _SPECS[kind][key](value)
        except ValueError:
            raise ConfigError(f"--inject {spec!r}: {key}={value!r} is not a {_SPECS[kind][key].__name__}") from None
    missing = _SPECS[kind].keys() - _OPTIONAL.get(kind, set()) - params.keys()
    if missing:
        raise ConfigError(f"--inject {spec!r}: missing {', '.join(sorted(missing))}; e.g. {_EXAMPLE}")
    if kind == "straggler" and "stage" not in params and "rank" not in params:
        raise ConfigError(f"--inject {spec!r}: missing stage (or rank); e.g. straggler:stage=1,ms=30")
    if kind == "slow-collective" and params["group"] not in (GroupRole.TP, GroupRole.PP, GroupRole.DP):
        raise ConfigError(f"--inject {spec!r}: group must be tp, pp or dp")
    if kind == "slow-link" and params["src"] == params["dst"]:
        raise ConfigError(f"--inject {spec!r}: src and dst must be two different ranks (a pipeline neighbour pair)")
    for key in ("ms", "src", "dst", "rank"):
        if kind in ("slow-link", "slow-data") and key in params and params[key] < 0:
            raise ConfigError(f"--inject {spec!r}: {key} must be >= 0")
    if kind == "loss-spike":
        params.setdefault("factor", SPIKE_FACTOR)
        if not params["factor"] > 1:
            raise ConfigError(f"--inject {spec!r}: factor must be > 1 (a spike raises the loss)")
    _check_campaign_fault(spec, kind, params)
    if kind == "hang":
        params.setdefault("where", "compute")
        if params["where"] not in HANG_PLACES:
            raise ConfigError(
                f"--inject {spec!r}: where={params['where']!r} is not one of "
                f"{', '.join(HANG_PLACES)}; e.g. hang:rank=1,step=5,where=send"
            )
    return Fault(kind, params)


class Faults:
    """The faults in force for one rank, asked at the points where they act."""

    def __init__(self, faults: list[Fault], rank: int, stage: int):
        self.faults = faults
        self.rank, self.stage = rank, stage
        self._done: set[tuple[str, int]] = set()  # (kind, step) of the once-per-process faults that struck
        self._hangs = {
            f.params["step"]: f.params["where"] for f in faults if f.kind == "hang" and f.params["rank"] == rank
        }
        self._step = 0  # the step being executed (begin_step), for the hang points in parwatch.trainer.comm

    def straggler_ms(self, step: int) -> float:
        return sum(
            f.params["ms"]
            for f in self.faults
            if f.kind == "straggler"
            and f.params.get("stage", self.stage) == self.stage
            and f.params.get("rank", self.rank) == self.rank
            and step >= f.params.get("from_step", 1)
        )

    def nan_now(self, step: int) -> bool:
        return self._once("nan", step)

    def loss_factor(self, step: int, data_step: int) -> float:
        """What the loss of this computation of `step` (training batch `data_step`) is multiplied by: NaN
        for a nan fault (once) or a bad batch (every time), a spike's factor (once), else 1."""
        if any(f.kind == "bad-batch" and f.params["step"] == data_step for f in self.faults) or self.nan_now(step):
            return math.nan
        spike = next((f for f in self.faults if f.kind == "loss-spike" and f.params["step"] == step), None)
        if spike is not None and self._once("loss-spike", step):
            return spike.params["factor"]
        return 1.0

    def corrupt_grads_now(self, step: int) -> bool:
        """An sdc fault of this rank at `step`, once per process: corrupt a gradient now."""
        return any(f.kind == "sdc" and f.params["rank"] == self.rank for f in self.faults) and self._once(
            "sdc", step, lambda f: f.params["rank"] == self.rank
        )

    def _once(self, kind: str, step: int, also=lambda f: True) -> bool:
        for f in self.faults:
            if f.kind == kind and f.params["step"] == step and also(f) and (kind, step) not in self._done:
                self._done.add((kind, step))
                return True
        return False

    def crash_now(self, step: int) -> bool:
        return self._due("crash", step)

    def raise_now(self, step: int) -> bool:
        return self._due("raise", step)

    def _due(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and f.params["rank"] == self.rank and f.params["step"] == step for f in self.faults)

    def slow_collectives(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for f in self.faults:
            if f.kind == "slow-collective":
                out[f.params["group"]] = out.get(f.params["group"], 0.0) + f.params["ms"]
        return out

    # -- slow-link / slow-data ----------------------------------------------------------------
    def link_delays_ms(self) -> dict[int, float]:
        """Destination rank -> extra ms inside every p2p send this rank makes to it."""
        out: dict[int, float] = {}
        for f in self.faults:
            if f.kind == "slow-link" and f.params["src"] == self.rank:
                out[f.params["dst"]] = out.get(f.params["dst"], 0.0) + f.params["ms"]
        return out

    def data_delay_ms(self) -> float:
        """Extra ms inside every data fetch of this rank."""
        return sum(f.params["ms"] for f in self.faults if f.kind == "slow-data" and f.params["rank"] == self.rank)

    # -- hang faults: the rank blocks for good, its process (and its threads) alive -------------
    def begin_step(self, step: int) -> None:
        self._step = step

    def hang_due(self, where: str) -> bool:
        return bool(self._hangs) and self._hangs.get(self._step) == where

    def hang_if(self, where: str) -> None:
        """Block forever if a hang is injected here (`where` in HANG_PLACES) at the current step."""
        if where == "kernel" and self.hang_due(where) and spin_device_forever():
            import logging
            import time

            logging.getLogger("trainer").error(
                "rank %d: injected hang (kernel) at step %d, blocking at %.3f", self.rank, self._step, time.time()
            )
            self._hangs.pop(self._step)  # the device spins; the host goes on until it waits for it
            return
        if self.hang_due(where):
            import logging
            import time

            # The wall time it blocks: tests and benchmarks time the leader's decision from here.
            logging.getLogger("trainer").error(
                "rank %d: injected hang (%s) at step %d, blocking at %.3f", self.rank, where, self._step, time.time()
            )
            threading.Event().wait()  # releases the GIL: the collector's threads keep reporting

    # -- the fault campaign's kinds (issue 44) ------------------------------------------------
    def checkpoint_delay_ms(self) -> float:
        """Extra ms inside every checkpoint save (slow-checkpoint)."""
        return sum(f.params["ms"] for f in self.faults if f.kind == "slow-checkpoint")

    def eval_ms(self, step: int) -> float:
        """The eval pass due after the boundary of `step`, in ms (0: none)."""
        return sum(f.params["ms"] for f in self.faults if f.kind == "eval-pause" and step % f.params["every"] == 0)

    def warmup_ms(self, step: int) -> float:
        """Extra ms in the first step's first forward (warmup), 0 on every other step."""
        return sum(f.params["ms"] for f in self.faults if f.kind == "warmup") if step == 1 else 0.0

    def hiccup_if_due(self, step: int) -> None:
        """Stop this rank for a while if a hiccup is due at `step` (its training thread, or the whole process)."""
        for f in self.faults:
            if f.kind == "hiccup" and f.params["rank"] == self.rank and f.params["step"] == step:
                import logging
                import time

                seconds = f.params["ms"] / 1000.0
                logging.getLogger("trainer").warning(
                    "rank %d: injected hiccup (%s) of %.3f s at step %d, from %.3f",
                    self.rank,
                    f.params["how"],
                    seconds,
                    step,
                    time.time(),
                )
                if f.params["how"] == "sleep":
                    time.sleep(seconds)
                else:
                    _stop_whole_process(seconds)


def _stop_whole_process(seconds: float) -> None:
    """SIGSTOP this process (every thread: its reporter too) and have a child SIGCONT it after `seconds`."""
    import os
    import signal
    import subprocess

    subprocess.Popen(["sh", "-c", f"sleep {seconds:.3f}; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def spin_device_forever() -> bool:
    """Enqueue a CUDA kernel that spins for good (torch.cuda._sleep of 2**62 cycles) without waiting for
    it; False without CUDA."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    torch.cuda._sleep(1 << 62)
    return True
