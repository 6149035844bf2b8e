"""What the demo runs: the layout, and the fault each scenario injects mid-run."""

from __future__ import annotations

from dataclasses import dataclass

from parwatch.report.stats import DEFAULT_PRICE_PER_GPU_HOUR
from parwatch.vocabulary import ScheduleName

SCENARIOS = ("none", "straggler", "nan")


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 40
    """Optimizer steps the trainer must complete (at least 2)."""
    scenario: str = "none"
    """none, straggler (stage 1 slows from mid-run: the skew alert fires) or nan (the loss
    turns NaN mid-run and, the check before the optimizer step off, reaches the weights: the sidecar
    rolls back to a checkpoint and the run completes)."""
    tp: int = 2
    """Tensor-parallel ranks per stage."""
    pp: int = 2
    """Pipeline stages; the trainer runs tp * pp ranks."""
    microbatches: int = 4
    """Microbatches per step (m in the bubble formula (p-1)/(m+p-1))."""
    schedule: str = ScheduleName.ONE_F_ONE_B.value
    """Pipeline schedule: gpipe or 1f1b."""
    checkpoint_every: int = 5
    """Steps between checkpoints. The nan scenario shortens it when needed so that a
    checkpoint exists before the NaN step (the rollback's target)."""
    straggler_ms: float = 80.0
    """Extra milliseconds per microbatch forward on stage 1 in the straggler scenario: enough
    to push the skew well past the default rule's 1.25 even on a loaded 2-core machine."""
    price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR
    """USD per accelerator-hour, to price the idle time in the summary."""

    @property
    def fault_step(self) -> int:
        """The step from which the straggler slows stage 1 (mid-run, never the first step)."""
        return max(2, self.steps // 2)

    @property
    def nan_step(self) -> int:
        """The step whose loss turns NaN: just past mid-run, always within 2..steps."""
        return self.steps // 2 + 1

    def checkpoint_interval(self) -> int:
        """checkpoint_every, shortened in the nan scenario so a checkpoint lands before nan_step:
        a checkpoint taken at or after the NaN holds poisoned weights, and without an earlier one
        the sidecar can only pause the run (and the demo would wait forever)."""
        if self.scenario == "nan":
            return max(1, min(self.checkpoint_every, self.nan_step - 1))
        return self.checkpoint_every

    def inject_args(self) -> list[str]:
        if self.scenario == "straggler":
            return ["--inject", f"straggler:stage=1,ms={self.straggler_ms:g},from_step={self.fault_step}"]
        if self.scenario == "nan":
            # The check before the optimizer step would re-run the step (a transient NaN): off, the NaN
            # reaches the weights and the demo shows the sidecar's rollback.
            return ["--pre-step-check", "off", "--inject", f"nan:step={self.nan_step}"]
        return []

    def trainer_args(self) -> list[str]:
        return [
            "--nproc",
            str(self.tp * self.pp),
            "--tp",
            str(self.tp),
            "--pp",
            str(self.pp),
            "--schedule",
            self.schedule,
            "--microbatches",
            str(self.microbatches),
            "--steps",
            str(self.steps),
            "--layers",
            "4",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--vocab",
            "64",
            "--seq-len",
            "32",
            "--checkpoint-every",
            str(self.checkpoint_interval()),
            *self.inject_args(),
        ]
