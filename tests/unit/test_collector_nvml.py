"""NVML sampler: field mapping and units with a fake pynvml, and the absent path (this machine)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from test_collector_sim import SimRank, SimRun, ctx_for, run_steps

from parwatch.collector.nvml import NvmlSampler


class FakeNvml:
    """The pynvml functions the sampler calls, with readings that change per sample."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, samples, throttle_name="nvmlDeviceGetCurrentClocksEventReasons") -> None:
        self.samples = samples  # list of dicts: util, used, total, power_mw, clock_mhz, temp, throttle
        self.i = -1
        self.handles = []
        self.shutdown = False
        setattr(self, throttle_name, lambda handle: self.samples[self.i]["throttle"])

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetHandleByIndex(self, index):
        self.handles.append(("index", index))
        return f"gpu{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.handles.append(("uuid", uuid))
        return "gpu-by-uuid"

    def nvmlDeviceGetIndex(self, handle):
        return 6

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.i += 1  # the first call of a sample
        return SimpleNamespace(gpu=self.samples[self.i]["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        s = self.samples[self.i]
        return SimpleNamespace(used=s["used"], total=s["total"], free=s["total"] - s["used"])

    def nvmlDeviceGetPowerUsage(self, handle):
        if self.samples[self.i]["power_mw"] is None:
            raise RuntimeError("NVMLError_NotSupported")
        return self.samples[self.i]["power_mw"]

    def nvmlDeviceGetClockInfo(self, handle, clock):
        assert clock == self.NVML_CLOCK_SM
        return self.samples[self.i]["clock_mhz"]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self.samples[self.i]["temp"]


def sample(util, used, power_mw, clock_mhz, temp, throttle, total=80 * 2**30):
    return dict(util=util, used=used, total=total, power_mw=power_mw, clock_mhz=clock_mhz, temp=temp, throttle=throttle)


def test_one_sample_maps_fields_to_base_units():
    fake = FakeNvml([sample(87, 3 * 2**30, 312_500, 1980, 71, 0x4)])
    sampler = NvmlSampler(0, nvml=fake)
    assert sampler.open() and sampler.up
    s = sampler.sample_once()
    assert s == {
        "utilization_ratio": 0.87,
        "memory_used_bytes": 3 * 2**30,
        "memory_total_bytes": 80 * 2**30,
        "power_watts": 312.5,
        "sm_clock_hertz": 1.98e9,
        "temperature_celsius": 71.0,
        "throttle_reasons": 0x4,
    }


def test_step_summary_means_maxima_and_or_of_throttle_reasons():
    fake = FakeNvml(
        [
            sample(50, 10, 200_000, 1000, 60, 0x1),
            sample(100, 30, 300_000, 2000, 75, 0x4),
            sample(90, 20, None, 1500, 70, 0x0),
        ],
        throttle_name="nvmlDeviceGetCurrentClocksThrottleReasons",
    )
    sampler = NvmlSampler(0, nvml=fake)
    sampler.open()
    for _ in range(3):
        sampler.sample_once()
    gpu = sampler.take()
    assert gpu.index == 0
    assert abs(gpu.utilization_ratio - 0.8) < 1e-12
    assert gpu.power_watts == 250.0  # mean of the samples that had a power reading
    assert gpu.sm_clock_hertz == 1.5e9
    assert gpu.memory_used_bytes == 30 and gpu.temperature_celsius == 75.0
    assert gpu.throttle_reasons == 0x5
    # the next step has no sample of its own yet: it repeats the latest reading
    again = sampler.take()
    assert again.utilization_ratio == 0.9 and again.throttle_reasons == 0 and again.power_watts is None


def test_cuda_visible_devices_maps_torch_indices_to_nvml_devices():
    fake = FakeNvml([])
    sampler = NvmlSampler(1, nvml=fake, env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert sampler.open() and sampler.index == 3 and fake.handles == [("index", 3)]
    fake = FakeNvml([])
    sampler = NvmlSampler(0, nvml=fake, env={"CUDA_VISIBLE_DEVICES": "GPU-1234abcd"})
    assert sampler.open() and sampler.index == 6 and fake.handles == [("uuid", "GPU-1234abcd")]


def test_failing_nvml_init_is_absent_without_a_thread():
    class Broken(FakeNvml):
        def nvmlInit(self):
            raise OSError("NVML Shared Library Not Found")

    sampler = NvmlSampler(0, nvml=Broken([])).start()
    assert not sampler.up and sampler.take() is None and sampler._thread is None
    sampler = NvmlSampler(None, nvml=FakeNvml([])).start()  # a CPU rank never tries
    assert not sampler.up and sampler._thread is None


def test_collector_reports_the_gpu_from_the_sampling_thread_and_stops_it():
    fake = FakeNvml([sample(40 + i % 10, 2**30, 100_000, 1400, 50, 0) for i in range(100_000)])
    run = SimRun(
        [SimRank(ctx_for(r, local_gpu=r), nvml=fake, nvml_interval_s=0.001, memory_fn=lambda: 123) for r in range(2)]
    )
    collector = run.ranks[0].collector
    deadline = time.monotonic() + 30
    while fake.i < 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    run.boundary(0, "start", 0.0, 0.1)
    run_steps(run, 1, 0.1)
    s = collector.last_summary
    assert s.nvml_up == 1 and s.memory_max_allocated_bytes == 123
    assert s.gpu is not None and s.gpu.index == 0 and s.gpu.memory_total_bytes is not None
    assert 0.4 <= s.gpu.utilization_ratio <= 0.49 and s.gpu.power_watts == 100.0
    for rank in run.ranks:
        rank.collector.close(timeout=30)
    assert fake.shutdown and not collector.nvml._thread.is_alive()


def test_this_machine_has_no_nvml_and_summaries_say_so():
    # nvml=None: the real pynvml (nvidia-ml-py) is imported; without a driver nvmlInit fails
    run = SimRun([SimRank(ctx_for(r, local_gpu=0)) for r in range(2)])
    run.boundary(0, "start", 0.0, 0.1)
    run_steps(run, 1, 0.1)
    s = run.ranks[0].collector.last_summary
    for rank in run.ranks:
        rank.collector.close(timeout=30)
    if s.nvml_up:
        pytest.skip("this machine has an NVML driver; the fake-module tests cover the mapping")
    assert s.gpu is None and run.ranks[1].collector.last_summary.nvml_up == 0
