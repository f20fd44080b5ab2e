"""The GPU's SM clock, power and throttle reasons while a benchmark runs, from NVML.

A timing is only as comparable as the clock it ran at. On an H200 a sustained
training step drew the board's 700 W limit and the driver lowered the SM clock
to 1,455-1,650 MHz (of 1,980) to stay under it, while a short burst of work can
run near the full clock: a kernel's time alone need not be its time inside the
step. So each record carries the clocks it ran at.

``ClockSampler`` polls NVML (``pynvml``, from ``nvidia-ml-py``) in a daemon
thread and summarises named windows::

    with ClockSampler() as clocks:
        with clocks.window("timed"):
            ...                              # the timed loop
    row["gpu_clocks"] = clocks.summary("timed")
    print(format_summary(row["gpu_clocks"]))

Without pynvml or an NVIDIA driver (the CPU machines) nothing raises: every
summary is ``{"available": False, "reason": ...}``. The NVML queries sit
behind a small reader (``NvmlReader``; ``open_reader`` builds one), so tests
drive the sampler with a fake.
"""

import contextlib
import os
import statistics
import threading
import time
from typing import NamedTuple

# Summary name -> (the suffix of pynvml's constant, nvml.h's bit for pynvml
# releases without it). The bits are NVML's ABI, the same in every driver.
REASONS = {
    "sw_power_cap": ("SwPowerCap", 0x4),             # the board's power limit
    "hw_slowdown": ("HwSlowdown", 0x8),              # the board's slowdown signal (power or heat)
    "sw_thermal": ("SwThermalSlowdown", 0x20),       # the driver's temperature limit
    "hw_thermal": ("HwThermalSlowdown", 0x40),
    "hw_power_brake": ("HwPowerBrakeSlowdown", 0x80),  # an external power brake
}


class ClocksUnavailable(RuntimeError):
    """NVML cannot be read here (no pynvml, no driver, no such device)."""


class Sample(NamedTuple):
    """One reading; a field NVML would not give is None."""

    t: float  # time.monotonic() seconds
    sm_mhz: float | None
    power_w: float | None
    temp_c: float | None
    reasons: int | None  # the clock-event (throttle) reasons bitmask


def reason_bits(nvml=None) -> dict[str, int]:
    """Each of ``REASONS``'s bits: pynvml's named constant where ``nvml`` has it."""
    return {name: getattr(nvml, f"nvmlClocksEventReason{suffix}", None)
            or getattr(nvml, f"nvmlClocksThrottleReason{suffix}", bit)
            for name, (suffix, bit) in REASONS.items()}


def nvml_device(device_index: int, environ=None) -> int | str:
    """NVML's index (or UUID) of CUDA's ``device_index``-th visible device.

    NVML ignores ``CUDA_VISIBLE_DEVICES``, so its entry for ``device_index``
    names the device (the first entry for device 0). This assumes CUDA orders
    the devices as NVML does, by PCI bus, as it does on a machine of one GPU model.

    Raises:
      ClocksUnavailable: ``CUDA_VISIBLE_DEVICES`` lists fewer devices, or an
        entry that is neither an index nor a ``GPU-`` UUID.
    """
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return device_index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if device_index >= len(entries):
        raise ClocksUnavailable(f"CUDA_VISIBLE_DEVICES={visible!r} has no device {device_index}")
    entry = entries[device_index]
    if entry.isdigit():
        return int(entry)
    if entry.startswith("GPU-"):
        return entry
    raise ClocksUnavailable(f"CUDA_VISIBLE_DEVICES entry {entry!r} is neither an index nor a GPU UUID")


def _or_none(query, scale=1.0):
    try:
        return query() * scale
    except Exception:  # noqa: BLE001 - a field this board does not report
        return None


class NvmlReader:
    """NVML's readings of one device; ``close`` shuts NVML down."""

    def __init__(self, nvml, handle):
        self._nvml, self._handle = nvml, handle
        self.reason_bits = reason_bits(nvml)
        # nvmlDeviceGetCurrentClocksEventReasons is the newer name of the same query.
        self._reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def read(self) -> Sample:
        nvml, h = self._nvml, self._handle
        return Sample(
            t=time.monotonic(),
            sm_mhz=_or_none(lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
            power_w=_or_none(lambda: nvml.nvmlDeviceGetPowerUsage(h), 1e-3),  # mW
            temp_c=_or_none(lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            reasons=_or_none(lambda: self._reasons(h), 1),
        )

    def rated(self) -> tuple[float | None, float | None]:
        """(max SM clock in MHz, enforced power limit in W)."""
        nvml, h = self._nvml, self._handle
        return (_or_none(lambda: nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM)),
                _or_none(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(h), 1e-3))

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def open_reader(device_index: int) -> NvmlReader:
    """An ``NvmlReader`` of CUDA's ``device_index``-th visible device.

    Raises:
      ClocksUnavailable: pynvml is not importable, NVML does not start (no
        driver), or the device is not there.
    """
    try:
        import pynvml
    except ImportError as e:
        raise ClocksUnavailable(f"pynvml not importable ({e}); pip install nvidia-ml-py") from e
    device = nvml_device(device_index)
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        raise ClocksUnavailable(f"nvmlInit failed: {type(e).__name__}: {e}") from e
    try:
        handle = (pynvml.nvmlDeviceGetHandleByUUID(device) if isinstance(device, str)
                  else pynvml.nvmlDeviceGetHandleByIndex(device))
    except Exception as e:  # noqa: BLE001
        pynvml.nvmlShutdown()
        raise ClocksUnavailable(f"no NVML device {device!r}: {type(e).__name__}: {e}") from e
    return NvmlReader(pynvml, handle)


class ClockSampler:
    """Samples a GPU every ``interval_s`` in a daemon thread while entered.

    ``window(name)`` marks a span and takes a sample at its entry and exit, so
    even a span shorter than the interval has two; ``summary(name)``
    summarises the samples inside it. A second window of the same name
    replaces the first. ``open_reader(device_index)`` builds the reader: an
    object with ``read() -> Sample``, ``rated() -> (max MHz, limit W)``,
    ``close()`` and ``reason_bits`` (``reason_bits()``'s dict).
    """

    def __init__(self, device_index: int = 0, interval_s: float = 0.1, open_reader=open_reader):
        self.device_index, self.interval_s = device_index, interval_s
        self._open = open_reader
        self._reader = None
        self.unavailable = None  # why nothing is sampled, once entered
        self.read_error = None  # the first reading that raised
        self._samples: list[Sample] = []
        self._windows: dict[str, tuple[int, int | None]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._rated = (None, None)
        self._bits = reason_bits()

    def __enter__(self):
        try:
            self._reader = self._open(self.device_index)
            self._rated = self._reader.rated()
            self._bits = self._reader.reason_bits
        except Exception as e:  # noqa: BLE001 - the benchmark must run without clocks
            self.unavailable = str(e) if isinstance(e, ClocksUnavailable) else f"{type(e).__name__}: {e}"
            self._close_reader()
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, name="ClockSampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._close_reader()  # after the join: no reading races NVML's shutdown
        return False

    def _close_reader(self):
        if self._reader is not None:
            with contextlib.suppress(Exception):
                self._reader.close()
            self._reader = None

    def _poll(self):
        while not self._stop.wait(self.interval_s):
            self._take()

    def _take(self) -> None:
        reader = self._reader
        if reader is None:
            return
        try:
            sample = reader.read()
        except Exception as e:  # noqa: BLE001 - a lost reading must not stop the benchmark
            self.read_error = self.read_error or f"{type(e).__name__}: {e}"
            return
        with self._lock:
            self._samples.append(sample)

    @contextlib.contextmanager
    def window(self, name: str):
        """Mark the span of the ``with`` block as window ``name``."""
        self.start(name)
        try:
            yield self
        finally:
            self.stop(name)

    def start(self, name: str) -> None:
        """Open window ``name`` (``window``'s entry, for spans that are not one block)."""
        with self._lock:
            self._windows[name] = (len(self._samples), None)
        self._take()

    def stop(self, name: str) -> None:
        """Close window ``name``, opened by ``start``.

        Raises:
          KeyError: no window ``name`` was started.
        """
        start, _ = self._windows[name]
        self._take()
        with self._lock:
            self._windows[name] = (start, len(self._samples))

    def reset(self) -> None:
        """Forget every sample and window: a long run keeps only its current window's."""
        with self._lock:
            self._samples.clear()
            self._windows.clear()

    def summary(self, name: str) -> dict:
        """``summarize`` of window ``name``'s samples (an open window's so far).

        Raises:
          KeyError: NVML was readable and no window ``name`` was opened.
        """
        if self.unavailable is not None:
            return {"available": False, "reason": self.unavailable}
        with self._lock:
            start, end = self._windows[name]
            samples = self._samples[start:end]
        return summarize(samples, *self._rated, self._bits, self.read_error)


def _median(values):
    return statistics.median(values) if values else None


def summarize(samples: list[Sample], sm_mhz_max_rated=None, power_limit_w=None,
              bits: dict[str, int] | None = None, read_error: str | None = None) -> dict:
    """Median/min/max of the readings and, per reason in ``REASONS``, the
    fraction of samples (of those with reasons) in which it held.

    NVML's power reading is an average, so the power-cap bit can hold while
    the reading is far below the limit: the clock says how much was lost, the
    bits say why. ``{"available": False, ...}`` when there are no samples.
    """
    if not samples:
        return {"available": False, "reason": f"no samples ({read_error or 'none taken'})"}
    bits = bits or reason_bits()
    sm = [s.sm_mhz for s in samples if s.sm_mhz is not None]
    power = [s.power_w for s in samples if s.power_w is not None]
    temp = [s.temp_c for s in samples if s.temp_c is not None]
    reasons = [int(s.reasons) for s in samples if s.reasons is not None]
    out = {
        "available": True,
        "n_samples": len(samples),
        "duration_s": samples[-1].t - samples[0].t,
        "sm_mhz_median": _median(sm),
        "sm_mhz_min": min(sm, default=None),
        "sm_mhz_max": max(sm, default=None),
        "sm_mhz_max_rated": sm_mhz_max_rated,
        "power_w_median": _median(power),
        "power_w_max": max(power, default=None),
        "power_limit_w": power_limit_w,
        "temp_c_max": max(temp, default=None),
    }
    for name, bit in bits.items():
        out[f"{name}_frac"] = sum(bool(r & bit) for r in reasons) / len(reasons) if reasons else None
    if read_error:
        out["read_error"] = read_error
    return out


# Reason -> how the one-line summary names it.
_REASON_WORDS = {"sw_power_cap": "power-capped", "hw_slowdown": "HW slowdown",
                 "sw_thermal": "SW thermal slowdown", "hw_thermal": "HW thermal slowdown",
                 "hw_power_brake": "HW power brake"}


def _num(x, unit=""):
    return "?" if x is None else f"{x:,.0f}{unit}"


def format_summary(summary: dict) -> str:
    """One line, e.g. "SM clock median 1,560 MHz (1,455-1,650; 1,980 max), power 688 W median
    of a 700 W limit, power-capped in 92% of samples"."""
    if not summary.get("available"):
        return f"GPU clocks not sampled: {summary.get('reason', 'unknown')}"
    s = summary
    text = (f"SM clock median {_num(s['sm_mhz_median'], ' MHz')} ({_num(s['sm_mhz_min'])}-"
            f"{_num(s['sm_mhz_max'])}; {_num(s['sm_mhz_max_rated'])} max), power "
            f"{_num(s['power_w_median'], ' W')} median of a {_num(s['power_limit_w'], ' W')} limit")
    held = [(word, s.get(f"{name}_frac")) for name, word in _REASON_WORDS.items()]
    held = [f"{word} in {frac:.0%}" for word, frac in held if frac]
    text += (", " + ", ".join(held) + " of samples") if held else ", no clock throttling"
    return text + f" ({s['n_samples']} samples)"
