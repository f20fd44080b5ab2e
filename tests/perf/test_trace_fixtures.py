"""The trace parser and categoriser on real traces captured by jax.profiler.

Fixtures come from ``benchmarks/capture_trace_fixture.py`` (see its docstring):
``cpu_trace.json.gz`` captured on CPU, ``gpu_trace.json.gz`` on an H200. Each
has a ``.meta.json`` saying what ran, and the breakdown must show exactly
those categories. The GPU test is skipped until that fixture is committed.
"""

import json
import math
import re
from pathlib import Path

import pytest

from dropless.perf import breakdown
from dropless.perf.breakdown import (ATTENTION, COMMUNICATION, COPY, DENSE_GEMM, GROUPED_GEMM,
                                     OTHER, QUANTIZATION)
from dropless.perf.trace import load_trace, read_events

FIXTURES = Path(__file__).parent / "fixtures"
# Kernel names that are GEMMs whatever else they are: never left in "other".
GEMM_NAMES = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|mosaic_gpu", re.IGNORECASE)


def _load(platform):
    path = FIXTURES / f"{platform}_trace.json.gz"
    if not path.exists():
        pytest.skip(f"{path.name} not captured yet: run benchmarks/capture_trace_fixture.py "
                    f"on the {platform.upper()} machine and commit its output")
    meta = json.loads((FIXTURES / f"{platform}_trace.meta.json").read_text())
    return load_trace(path), meta


def _check_common(trace, meta):
    bd = breakdown.compute(trace)
    assert trace.platform == meta["platform"]
    assert bd.steps == meta["steps"]
    assert bd.kernel_us > 0 and bd.wall_us > 0
    assert math.isclose(sum(c["pct_kernel"] for c in bd.categories), 100.0, rel_tol=1e-9)
    assert all(k.dur_us >= 0 for k in trace.kernels)
    times = [k["time_us"] for k in bd.top_kernels]
    assert 0 < len(times) <= 15 and times == sorted(times, reverse=True)
    distinct = {k.name for k in trace.kernels}
    assert len(bd.top_kernels) == min(15, len(distinct))
    assert (bd.pct(COMMUNICATION) > 0) == meta["communication"]
    assert (bd.pct(DENSE_GEMM) > 0) == meta["dense_matmul"]
    assert (bd.pct(COPY) > 0) == meta["host_device_copies"]
    # Both fixtures are bf16 runs: nothing in them is FP8 quantization.
    assert (bd.pct(QUANTIZATION) > 0) == meta.get("fp8", False)
    return bd


def test_cpu_fixture():
    trace, meta = _load("cpu")
    bd = _check_common(trace, meta)
    assert trace.devices == ["/host:CPU"]
    # XLA:CPU traces carry no jax op names, so ragged_dot's dots look dense there.
    assert bd.pct(GROUPED_GEMM) == 0.0 and bd.pct(ATTENTION) == 0.0
    # Exclusive times never exceed the raw event durations.
    raw = sum(e["dur"] for e in read_events(FIXTURES / "cpu_trace.json.gz")
              if e.get("ph") == "X" and "hlo_op" in e.get("args", {})
              and not e["name"].startswith("end: "))
    assert bd.kernel_us <= raw + 1e-6


def test_gpu_fixture():
    trace, meta = _load("gpu")
    bd = _check_common(trace, meta)
    assert all(d.startswith("/device:GPU:") for d in trace.devices)
    assert (bd.pct(GROUPED_GEMM) > 0) == bool(meta["gmm_backends"])
    assert (bd.pct(ATTENTION) > 0) == meta["attention"]
    if "xla" in meta["gmm_backends"]:
        # XLA's ragged_dot is only recognisable by its op name. Inside XLA command
        # buffers (CUDA graphs, on by default) kernels carry the command buffer's
        # name instead, as in this H200 fixture; then the expanded ragged_dot
        # kernels can only count as dense GEMM.
        ops = {k.op for k in trace.kernels}
        in_graphs = any(op.startswith("command_buffer") for op in ops)
        assert in_graphs or any("ragged" in op for op in ops)
    if "mosaic" in meta["gmm_backends"]:
        assert any(breakdown.categorise(k.name) == GROUPED_GEMM for k in trace.kernels)
    leftovers = {k.name for k in trace.kernels
                 if breakdown.categorise(k.name, k.op) == OTHER and GEMM_NAMES.search(k.name)}
    assert not leftovers, f"GEMM kernels categorised as other: {sorted(leftovers)[:5]}"
