"""CPU-only shims that let megatron-core 0.16 train on gloo without CUDA. Used by
examples/megatron_gpt.py only when `torch.cuda.is_available()` is False; never by parwatch.

Megatron assumes a GPU in three places a CPU run reaches:
- `torch.cuda.current_device()` names the device of buffers it allocates (tensor-parallel
  gathers, p2p receive buffers, attention masks): pointed at "cpu", as Megatron's own unit
  tests do on CPU;
- its schedules count tokens in `torch.zeros(..., device="cuda")`: that one module sees a `torch`
  whose `zeros` puts "cuda" tensors on the CPU (no other module is affected);
- `batch_p2p_sync` calls `torch.cuda.synchronize()`: the example's config sets it False;
- its dropout forks a CUDA RNG state ("model-parallel-rng"): the tracker keeps CPU RNG states
  (the example's dropout is 0, so no random number is drawn from them).
"""

from __future__ import annotations

import types

import torch


def install() -> None:
    """Apply the shims (idempotent). Call after `import torch`, before building Megatron models."""
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu: CUDA is available; run Megatron on the GPU instead")
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _CpuTorch):
        schedules.torch = _CpuTorch(torch)
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    tracker = random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.set_states({random._MODEL_PARALLEL_RNG_TRACKER_NAME: torch.get_rng_state()})


class _CpuTorch(types.ModuleType):
    """`torch` for one module, with device="cuda" allocations placed on the CPU."""

    def __init__(self, real) -> None:
        super().__init__("torch")
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def zeros(self, *args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return self._real.zeros(*args, **kwargs)
