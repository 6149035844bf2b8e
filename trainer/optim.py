"""The reference trainer's optimizers: torch's SGD (plain) and AdamW (no weight decay), op for op as torch's
single-tensor forms compute them, so a step's weights are bitwise torch's on CPU.

They are written here because building any torch.optim optimizer imports torch._dynamo (its methods are
wrapped in torch._disable_dynamo), 1.0-1.2 s of CPU in every process that builds one: every rank that
torchrun starts, where 2.5 s is the whole import. Hooks registered with torch.optim.optimizer's
register_optimizer_step_pre_hook / _post_hook run around each step as they do for torch's own.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import optimizer as torch_optimizer


class Optimizer:
    """One parameter group; `state_dict()` has torch's layout (state by parameter index, param_groups)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, **defaults: object):
        self.param_groups: list[dict] = [{"params": list(params), "lr": lr, **defaults}]
        self.state: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    @torch.no_grad()
    def step(self) -> None:
        # The global hooks' registries are torch's (private dicts; the public functions only add to them).
        for hook in list(torch_optimizer._global_optimizer_pre_hooks.values()):
            hook(self, (), {})  # type: ignore[arg-type]  # the hooks read param_groups and state, which it has
        self._update(self.param_groups[0])
        for hook in list(torch_optimizer._global_optimizer_post_hooks.values()):
            hook(self, (), {})  # type: ignore[arg-type]

    def _update(self, group: dict) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {
            "state": {i: dict(s) for i, s in self.state.items()},
            "param_groups": [{**group, "params": list(range(len(self.params)))}],
        }

    def load_state_dict(self, state: dict) -> None:
        (group,) = state["param_groups"]
        if len(group["params"]) != len(self.params):
            raise ValueError(f"optimizer state for {len(group['params'])} parameters, this one has {len(self.params)}")
        self.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        self.state = {
            int(i): {k: v if k == "step" else v.to(self.params[int(i)].device) for k, v in s.items()}
            for i, s in state["state"].items()
        }


class SGD(Optimizer):
    def _update(self, group: dict) -> None:
        for p in group["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-group["lr"])


class AdamW(Optimizer):
    def __init__(self, params: Iterable[torch.Tensor], lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, lr, betas=betas, eps=eps, weight_decay=0.0)

    def _update(self, group: dict) -> None:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            s = self.state.get(i)
            if s is None:
                s = self.state[i] = {
                    "step": torch.tensor(0.0),  # on the CPU, in the default dtype: torch's
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
            grad, exp_avg, exp_avg_sq = p.grad, s["exp_avg"], s["exp_avg_sq"]
            s["step"] += 1
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = s["step"].item()
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-(lr / (1 - beta1**step)))
