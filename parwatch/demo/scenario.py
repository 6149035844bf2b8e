"""What the demo runs: the layout, and the fault each scenario injects mid-run."""

from __future__ import annotations

from dataclasses import dataclass

SCENARIOS = ("none", "straggler", "nan")


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 40
    """Optimizer steps the trainer must complete."""
    scenario: str = "none"
    """none, straggler (stage 1 slows from mid-run: the skew alert fires) or nan (the loss
    turns NaN mid-run: the sidecar rolls back to a checkpoint and the run completes)."""
    tp: int = 2
    pp: int = 2
    microbatches: int = 4
    schedule: str = "1f1b"
    checkpoint_every: int = 5
    straggler_ms: float = 40.0
    """Extra milliseconds per microbatch forward on stage 1 in the straggler scenario."""
    price_per_gpu_hour: float = 2.0

    def inject_args(self) -> list[str]:
        mid = max(2, self.steps // 2)
        if self.scenario == "straggler":
            return ["--inject", f"straggler:stage=1,ms={self.straggler_ms:g},from_step={mid}"]
        if self.scenario == "nan":
            return ["--inject", f"nan:step={mid + 1}"]
        return []

    def trainer_args(self) -> list[str]:
        return [
            "--nproc", str(self.tp * self.pp), "--tp", str(self.tp), "--pp", str(self.pp),
            "--schedule", self.schedule, "--microbatches", str(self.microbatches), "--steps", str(self.steps),
            "--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "64", "--seq-len", "32",
            "--checkpoint-every", str(self.checkpoint_every), *self.inject_args(),
        ]
