"""``dropless.perf.clocks``: NVML sampling of the SM clock, power and throttle reasons.

NVML needs an NVIDIA driver, so the sampler is driven by a fake reader
(``fake_nvml``, tests/conftest.py; and ``open_reader`` by a fake ``pynvml``
module); what is under test is the window
bookkeeping, the statistics, the thread's life and the paths without NVML.
"""

import sys
import threading
import time
import types

import pytest

from dropless.perf import clocks
from dropless.perf.clocks import ClockSampler, Sample

INTERVAL_S = 0.005  # background samples every 5 ms: a few per sleep below


def _sample(sm_mhz, reasons, power_w=600.0, temp_c=50.0):
    return Sample(0.0, sm_mhz, power_w, temp_c, reasons)


def test_summarize_statistics_and_reason_fractions():
    # Bit by bit in 4 samples: SW power cap in 4, HW slowdown in 3, SW thermal in 2,
    # HW thermal in 1, power brake in 0; 0x1 (GPU idle) is none of them.
    samples = [_sample(1400, 0x4 | 0x1, power_w=690), _sample(1500, 0x4 | 0x8, power_w=700),
               _sample(1600, 0x4 | 0x8 | 0x20, power_w=680),
               _sample(1980, 0x4 | 0x8 | 0x20 | 0x40, power_w=300, temp_c=71)]
    s = clocks.summarize(samples, 1980, 700)
    assert (s["n_samples"], s["sm_mhz_median"], s["sm_mhz_min"], s["sm_mhz_max"]) == (4, 1550, 1400, 1980)
    assert (s["power_w_median"], s["power_w_max"], s["temp_c_max"]) == (685, 700, 71)
    assert (s["sm_mhz_max_rated"], s["power_limit_w"]) == (1980, 700)
    fracs = {k: s[f"{k}_frac"] for k in clocks.REASONS}
    assert fracs == {"sw_power_cap": 1.0, "hw_slowdown": 0.75, "sw_thermal": 0.5,
                     "hw_thermal": 0.25, "hw_power_brake": 0.0}


def test_summarize_skips_fields_nvml_did_not_give():
    samples = [_sample(1500, None), _sample(None, 0x4), _sample(1700, 0x0)]
    s = clocks.summarize(samples)
    assert (s["n_samples"], s["sm_mhz_median"]) == (3, 1600)
    assert s["sw_power_cap_frac"] == 0.5  # of the two samples that have reasons


def test_reason_bits_take_pynvml_constants_where_present():
    nvml = types.SimpleNamespace(nvmlClocksEventReasonSwPowerCap=0x4000,
                                 nvmlClocksThrottleReasonHwSlowdown=0x8000)
    bits = clocks.reason_bits(nvml)
    assert bits["sw_power_cap"] == 0x4000 and bits["hw_slowdown"] == 0x8000
    assert bits["sw_thermal"] == 0x20  # nvml.h's value where the module lacks the name


def test_window_holds_only_the_samples_taken_inside_it(fake_nvml):
    reader = fake_nvml(sm_mhz=1000.0)
    with ClockSampler(interval_s=INTERVAL_S, open_reader=lambda i: reader) as s:
        time.sleep(10 * INTERVAL_S)
        reader.sm_mhz = 1500.0
        with s.window("timed"):
            time.sleep(10 * INTERVAL_S)
        reader.sm_mhz = 900.0
        time.sleep(10 * INTERVAL_S)
    summary = s.summary("timed")
    assert summary["available"] and summary["n_samples"] > 2  # background samples too
    assert summary["sm_mhz_min"] == summary["sm_mhz_max"] == 1500.0
    assert summary["sw_power_cap_frac"] == 1.0


def test_a_window_shorter_than_the_interval_has_its_entry_and_exit_samples(fake_nvml):
    reader = fake_nvml(sm_mhz=1560.0)
    with ClockSampler(interval_s=60.0, open_reader=lambda i: reader) as s:
        with s.window("short"):
            pass
    summary = s.summary("short")
    assert summary["n_samples"] == 2 and summary["sm_mhz_median"] == 1560.0


def test_the_thread_stops_and_the_reader_closes_on_exit(fake_nvml):
    reader = fake_nvml()
    with ClockSampler(interval_s=INTERVAL_S, open_reader=lambda i: reader):
        time.sleep(5 * INTERVAL_S)
        assert any(t.name == "ClockSampler" for t in threading.enumerate())
    reads = reader.reads
    time.sleep(5 * INTERVAL_S)
    assert reader.reads == reads and reader.closed
    assert not any(t.name == "ClockSampler" for t in threading.enumerate())


def test_without_pynvml_nothing_raises_and_the_summary_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with ClockSampler(interval_s=INTERVAL_S) as s, s.window("timed"):
        pass
    assert s.summary("timed") == {"available": False, "reason": s.unavailable}
    assert "pynvml not importable" in s.unavailable
    assert clocks.format_summary(s.summary("timed")).startswith("GPU clocks not sampled: pynvml")


def test_when_nvml_init_fails_nothing_raises_and_the_summary_says_why(monkeypatch):
    def no_driver():
        raise RuntimeError("Driver Not Loaded")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=no_driver))
    with ClockSampler(interval_s=INTERVAL_S) as s, s.window("timed"):
        pass
    summary = s.summary("timed")
    assert summary["available"] is False
    assert summary["reason"] == "nvmlInit failed: RuntimeError: Driver Not Loaded"


def test_failing_readings_give_an_unavailable_summary_not_an_exception(fake_nvml):
    with ClockSampler(interval_s=INTERVAL_S, open_reader=lambda i: fake_nvml(fail=True)) as s:
        with s.window("timed"):
            time.sleep(3 * INTERVAL_S)
    summary = s.summary("timed")
    assert summary["available"] is False and "GPU is lost" in summary["reason"]


def _fake_pynvml(calls):
    """A pynvml with the queries NvmlReader makes, in NVML's units (mW), and only the
    older throttle-reasons query."""
    return types.SimpleNamespace(
        NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: calls.append(("index", i)) or f"h{i}",
        nvmlDeviceGetClockInfo=lambda h, clock: 1455 if clock == 1 else 0,
        nvmlDeviceGetMaxClockInfo=lambda h, clock: 1980 if clock == 1 else 0,
        nvmlDeviceGetPowerUsage=lambda h: 688_000,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
        nvmlDeviceGetTemperature=lambda h, sensor: 64,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x4,
    )


def test_open_reader_reads_cuda_visible_devices_first_entry_in_watts(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(calls))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    reader = clocks.open_reader(0)
    sample = reader.read()
    assert (sample.sm_mhz, sample.power_w, sample.temp_c, sample.reasons) == (1455, 688.0, 64, 0x4)
    assert reader.rated() == (1980, 700.0)
    reader.close()
    assert calls == ["init", ("index", 3), "shutdown"]


@pytest.mark.parametrize("visible, index, want", [
    (None, 1, 1), ("3,5", 0, 3), ("3,5", 1, 5), (" 2 ", 0, 2),
    ("GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", 0, "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"),
])
def test_nvml_device_of_cuda_visible_devices(visible, index, want):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert clocks.nvml_device(index, environ) == want


@pytest.mark.parametrize("visible", ["", "0", "MIG-1"])
def test_nvml_device_without_that_device_is_unavailable(visible):
    index = 1 if visible == "0" else 0
    with pytest.raises(clocks.ClocksUnavailable):
        clocks.nvml_device(index, {"CUDA_VISIBLE_DEVICES": visible})


def test_format_summary_line():
    s = clocks.summarize([_sample(1560, 0x4, power_w=688)] * 23 + [_sample(1650, 0x0, power_w=600)] * 2,
                         1980, 700)
    assert clocks.format_summary(s) == (
        "SM clock median 1,560 MHz (1,560-1,650; 1,980 max), power 688 W median of a 700 W limit, "
        "power-capped in 92% of samples (25 samples)")


def test_start_stop_and_reset_keep_only_the_current_windows_samples(fake_nvml):
    """``start``/``stop`` mark a window across calls (the training loop's timing windows);
    ``reset`` drops what came before, so a long run does not accumulate samples."""
    reader = fake_nvml(sm_mhz=1500.0)
    with ClockSampler(interval_s=3600.0, open_reader=lambda index: reader) as s:
        s.start("w")
        reader.sm_mhz = 1700.0
        s.stop("w")
        assert s.summary("w")["sm_mhz_median"] == 1600.0 and len(s._samples) == 2
        s.reset()
        assert s._samples == [] and s._windows == {}
        s.start("w")
        s.stop("w")
        assert s.summary("w")["n_samples"] == 2 and s.summary("w")["sm_mhz_median"] == 1700.0
        with pytest.raises(KeyError):
            s.stop("never started")
