"""NVML sampler: one background thread reads the rank's GPU every `interval_s`.

The training thread only calls `take()` at a step boundary, which folds the
samples since the last call into the schema's `gpu` object (means of
utilisation, power and SM clock; maxima of memory used and temperature; OR of
throttle reasons) under a lock held for a few additions.

Without NVML (no driver, as on a CPU machine, or no GPU for this rank) the
sampler is "absent": `up` is False, `take()` returns None, no thread runs, and
one line is logged per process.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from parwatch.thread_names import daemon_thread
from parwatch.wire.steps import Gpu

log = logging.getLogger("parwatch.collector")
_absent_logged = False


def _log_absent_once(reason: str) -> None:
    global _absent_logged
    if not _absent_logged:
        _absent_logged = True
        log.info("parwatch: NVML unavailable (%s); GPU metrics off, parwatch_nvml_up 0", reason)


def _device_handle(nvml, cuda_index: int, env) -> tuple[int, object]:
    """NVML numbers GPUs physically; CUDA_VISIBLE_DEVICES may renumber them for torch."""
    visible = [e.strip() for e in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    if cuda_index < len(visible):
        entry = visible[cuda_index]
        if entry.isdigit():
            return int(entry), nvml.nvmlDeviceGetHandleByIndex(int(entry))
        handle = nvml.nvmlDeviceGetHandleByUUID(entry)
        return int(nvml.nvmlDeviceGetIndex(handle)), handle
    return cuda_index, nvml.nvmlDeviceGetHandleByIndex(cuda_index)


class NvmlSampler:
    """Samples one GPU in a daemon thread; `take()` gives the per-step summary."""

    def __init__(self, cuda_index: int | None, *, nvml=None, interval_s: float = 0.25, env=None) -> None:
        self.cuda_index = cuda_index
        self.interval_s = interval_s
        self.up = False
        """True once NVML answered for this rank's GPU."""
        self.index: int | None = None
        """The GPU's NVML (physical) index: the `gpu` label."""
        self.errors = 0
        """Samples that raised (the thread keeps going)."""
        self._nvml: Any = nvml  # the pynvml module, loaded on first use
        self._env = os.environ if env is None else env
        self._handle: object = None
        self._throttle_fn = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reset()
        self._last: dict | None = None

    def start(self) -> NvmlSampler:
        """Initialise NVML and start the sampling thread; on any failure stay absent."""
        if self.open():
            self._thread = daemon_thread(self._run, "parwatch-nvml")
            self._thread.start()
        return self

    def open(self) -> bool:
        """Initialise NVML and find this rank's GPU (no thread); False means absent."""
        if self.cuda_index is None:
            return False
        try:
            if self._nvml is None:
                import pynvml  # provided by nvidia-ml-py

                self._nvml = pynvml
            self._nvml.nvmlInit()
            self.index, self._handle = _device_handle(self._nvml, self.cuda_index, self._env)
        except Exception as exc:  # no library, no driver, no such GPU: all mean "absent"
            _log_absent_once(f"{type(exc).__name__}: {exc}")
            return False
        self._throttle_fn = getattr(self._nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            self._nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        self.up = True
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:
                self.errors += 1
            self._stop.wait(self.interval_s)

    def _read(self, fn, *args):
        try:
            return fn(self._handle, *args)
        except Exception:  # e.g. NVMLError_NotSupported for power on some boards
            return None

    def sample_once(self) -> dict:
        """Read every field once (base units) and fold it into the current step's sums."""
        nvml = self._nvml
        util = self._read(nvml.nvmlDeviceGetUtilizationRates)
        memory = self._read(nvml.nvmlDeviceGetMemoryInfo)
        power_mw = self._read(nvml.nvmlDeviceGetPowerUsage)
        clock_mhz = self._read(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM)
        temperature = self._read(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
        throttle = self._read(self._throttle_fn) if self._throttle_fn else None
        sample = {
            "utilization_ratio": None if util is None else util.gpu / 100.0,
            "memory_used_bytes": None if memory is None else int(memory.used),
            "memory_total_bytes": None if memory is None else int(memory.total),
            "power_watts": None if power_mw is None else power_mw / 1000.0,
            "sm_clock_hertz": None if clock_mhz is None else clock_mhz * 1e6,
            "temperature_celsius": None if temperature is None else float(temperature),
            "throttle_reasons": None if throttle is None else int(throttle),
        }
        with self._lock:
            self._fold(sample)
            self._last = sample
        return sample

    def _reset(self) -> None:
        self._sums = {"utilization_ratio": [0.0, 0], "power_watts": [0.0, 0], "sm_clock_hertz": [0.0, 0]}
        self._max: dict[str, float | None] = {"memory_used_bytes": None, "temperature_celsius": None}
        self._total: int | None = None
        self._throttle: int | None = None
        self._samples = 0

    def _fold(self, sample: dict) -> None:
        self._samples += 1
        for key, acc in self._sums.items():
            if sample[key] is not None:
                acc[0] += sample[key]
                acc[1] += 1
        for key, value in self._max.items():
            if sample[key] is not None and (value is None or sample[key] > value):
                self._max[key] = sample[key]
        if sample["memory_total_bytes"] is not None:
            self._total = sample["memory_total_bytes"]
        if sample["throttle_reasons"] is not None:
            self._throttle = (self._throttle or 0) | sample["throttle_reasons"]

    def take(self) -> Gpu | None:
        """A summary's `gpu` for the samples since the last call; None when absent.

        A step shorter than the interval has no sample of its own: it reports the latest one.
        """
        if not self.up or self.index is None:
            return None
        with self._lock:
            if self._samples == 0:
                if self._last is None:
                    return None
                self._fold(self._last)
            mean = {key: total / n if n else None for key, (total, n) in self._sums.items()}
            used = self._max["memory_used_bytes"]
            gpu = Gpu(
                index=self.index,
                utilization_ratio=mean["utilization_ratio"],
                memory_used_bytes=None if used is None else int(used),
                memory_total_bytes=self._total,
                power_watts=mean["power_watts"],
                sm_clock_hertz=mean["sm_clock_hertz"],
                temperature_celsius=self._max["temperature_celsius"],
                throttle_reasons=self._throttle,
            )
            self._reset()
        return gpu

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.up:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self.up = False
