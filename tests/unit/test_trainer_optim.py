"""The reference trainer's optimizers (trainer/optim.py) against torch's own: bitwise the same weights step for
step, a checkpoint's state restored whole, torch's global step hooks honoured, and no torch._dynamo import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from parwatch.trainer import optim

MINE = {"sgd": optim.SGD, "adamw": optim.AdamW}
TORCH = {"sgd": torch.optim.SGD, "adamw": lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0)}


def _train(make, dtype, steps: int = 6, model=None):
    torch.manual_seed(0)
    model = model or torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
    opt = make(list(model.parameters()), lr=1e-2)
    for i in range(steps):
        torch.manual_seed(100 + i)
        for p in model.parameters():
            p.grad = None
        model(torch.randn(5, 8, dtype=dtype)).pow(2).mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("name", sorted(MINE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_step_gives_torchs_weights_bitwise(name, dtype):
    mine, _ = _train(MINE[name], dtype)
    theirs, _ = _train(TORCH[name], dtype)
    assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), theirs.parameters()))


def test_a_restored_state_continues_as_if_never_stopped():
    whole, _ = _train(MINE["adamw"], torch.float32, steps=6)
    first, opt = _train(MINE["adamw"], torch.float32, steps=3)
    saved = opt.state_dict()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model.load_state_dict(first.state_dict())
    resumed = optim.AdamW(list(model.parameters()), lr=1.0)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["lr"] == 1e-2
    for i in range(3, 6):
        torch.manual_seed(100 + i)
        for p in model.parameters():
            p.grad = None
        model(torch.randn(5, 8)).pow(2).mean().backward()
        resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole.parameters()))
    with pytest.raises(ValueError, match="optimizer state for 4 parameters, this one has 1"):
        optim.SGD([torch.zeros(2)], lr=0.1).load_state_dict(saved)


def test_torchs_global_step_hooks_run_around_each_step():
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    seen: list[str] = []
    pre = register_optimizer_step_pre_hook(lambda o, a, k: seen.append("pre"))
    post = register_optimizer_step_post_hook(lambda o, a, k: seen.append("post"))
    try:
        _train(MINE["sgd"], torch.float32, steps=2)
    finally:
        pre.remove()
        post.remove()
    assert seen == ["pre", "post"] * 2


def test_building_and_stepping_one_does_not_import_torch_dynamo():
    code = (
        "import sys, torch\n"
        "from parwatch.trainer import optim\n"
        "p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)\n"
        "o = optim.AdamW([p], lr=0.1); o.step(); o.load_state_dict(o.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
