"""Shared pytest fixtures for the CPU test suite.

``rng`` hands each test a fresh NumPy generator: a new seed per test run (so
repeated runs explore new inputs), printed so a failure can be replayed with
``PYTEST_SEED=<seed>`` (not a ``DROPLESS_`` name: the CLI reads those as
config keys and rejects unknown ones). Hypothesis uses the "dropless" profile: no
per-example deadline (the first example of a shape pays for XLA compilation)
and few examples, to keep the suite fast on two cores.

The suite runs many tiny models, so XLA compile time dominates: unless
``XLA_FLAGS`` is already set, XLA:CPU is asked for backend optimisation level
0, which compiles about 3x faster. Results are the same; it is set here, the
first file pytest loads, so it is in place before any test starts the backend.

Many tests compile the same programs: a trainer test and the subprocess it
starts, the phases of a resumed run, a model built again in the next test.
Unless ``JAX_COMPILATION_CACHE_DIR`` is already set, the run gets one JAX
persistent compilation cache in a temporary directory, removed when the run
ends. It is set in the environment, so pytest-xdist workers and every
subprocess a test starts (which inherit it) share it: a program compiled once
is loaded, not compiled, everywhere else in the run. The cache key covers the
program, compile options, XLA flags, devices and jax version, so a hit is the
executable the compile would have made. Entries are written without a lock;
one read while another process is still writing it fails to decompress, and
JAX then warns and compiles.

The longest test files (``LONG_FIRST``, each 25-150 s on a two-core host, 2026-12-04)
are collected first: with ``-n 2 --dist worksteal`` (``make test``) a 150 s test
that starts late runs alone after the other worker has finished. Measured on an idle
two-core host the suite took 655 and 799 s with this order and 763 s without: within
its run-to-run spread, so the order is a guard against a bad tail, not a speed-up.

``@pytest.mark.slow`` marks a further case left out of the default run for CI time:
it is skipped unless ``DROPLESS_SLOW=1`` (the reason, ``slow(reason=...)`` or a
general one, ends with that setting; the multi-device suite's runner checks for it).

``fake_nvml`` stands in for NVML (``dropless.perf.clocks``' reader), which needs an
NVIDIA driver: readings as scripted, for the clock sampler, the benchmarks' records
and the training loop's rows.
"""

import atexit
import os
import shutil
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="dropless-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
# Every program, however quick its compile: at optimisation level 0 most take well under
# JAX's default threshold of one second.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The CLI's default compilation cache is ~/jax_cache (MaxText's); the suite's runs
# must not write into the home directory, so they run without it unless a test
# names its own directory.
os.environ.setdefault("DROPLESS_JAX_CACHE_DIR", "")
import secrets

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "dropless",
    deadline=None,
    max_examples=10,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dropless"))


@pytest.fixture
def rng():
    """A fresh ``np.random.Generator``; its seed is printed (shown on failure)."""
    seed = int(os.environ.get("PYTEST_SEED", secrets.randbits(32)))
    print(f"PYTEST_SEED={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def fp8_kernels_as_references(monkeypatch):
    """The FP8 grouped-GEMM kernels (``mosaic_fp8.gmm_fp8_blockwise``,
    ``mosaic_fp8_tgmm.tgmm_fp8_blockwise``) replaced by their float32 references, the
    products of the same codes and scales, whatever the schedule's keyword arguments, and
    ``mosaic.is_available`` true: on a CPU host the kernel path then runs everything
    around the kernels (the quantizers, the custom VJPs, the model) for real."""
    from dropless.ops.gmm import mosaic, mosaic_fp8, mosaic_fp8_tgmm

    monkeypatch.setattr(mosaic, "is_available", lambda: True)
    monkeypatch.setattr(mosaic_fp8, "gmm_fp8_blockwise",
                        lambda *ops, out_dtype, **kw: mosaic_fp8.reference(*ops, out_dtype=out_dtype))
    monkeypatch.setattr(mosaic_fp8_tgmm, "tgmm_fp8_blockwise",
                        lambda *ops, out_dtype, **kw: mosaic_fp8_tgmm.reference(*ops, out_dtype=out_dtype))


@pytest.fixture
def fake_nvml():
    """The class of a fake ``perf.clocks`` reader (``read``, ``rated``, ``close``,
    ``reason_bits``): each reading moves the SM clock by ``step`` MHz, then returns it
    (set ``sm_mhz`` between readings to script it), with ``power_w`` and the throttle
    ``reasons`` bits; ``fail`` makes every reading raise. Counts ``reads``; rated 1,980
    MHz and 700 W."""
    from dropless.perf import clocks

    class FakeNvml:
        reason_bits = clocks.reason_bits()

        def __init__(self, sm_mhz=1500.0, step=0.0, power_w=650.0, reasons=0x4, fail=False):
            self.sm_mhz, self.step, self.power_w = sm_mhz, step, power_w
            self.reasons, self.fail = reasons, fail
            self.reads, self.closed = 0, False

        def read(self):
            if self.fail:
                raise RuntimeError("GPU is lost")
            self.reads += 1
            self.sm_mhz += self.step
            return clocks.Sample(time.monotonic(), self.sm_mhz, self.power_w, 60.0, self.reasons)

        def rated(self):
            return 1980.0, 700.0

        def close(self):
            self.closed = True

    return FakeNvml


# Slowest first (seconds per file on a two-core host at c46f429, from --durations):
# the multi-device suite 149, two processes training 76, the benchmarks' CPU smoke 65,
# FP8 training against bf16 26 (the quantizer sweep's smoke, 31, runs with DROPLESS_SLOW=1).
LONG_FIRST = (
    "tests/parallel/test_multidevice.py",
    "tests/parallel/test_multiprocess_train.py",
    "tests/perf/test_bench.py",
    "tests/train/test_fp8_training.py",
)


SLOW_SETTING = "run with DROPLESS_SLOW=1"


def pytest_collection_modifyitems(config, items):
    """Run the ``LONG_FIRST`` files first; skip ``slow`` cases unless ``DROPLESS_SLOW=1``
    (module docstring). Otherwise keep the order."""
    items.sort(key=lambda item: not item.nodeid.startswith(LONG_FIRST))
    if os.environ.get("DROPLESS_SLOW") == "1":
        return
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is not None:
            why = marker.kwargs.get("reason", "a further case, left out for CI time")
            item.add_marker(pytest.mark.skip(reason=f"{why}; {SLOW_SETTING}"))
