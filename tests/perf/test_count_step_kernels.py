"""tools/count_step_kernels.py: its two counts on CPU, and its reading of optimized HLO text."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp

_PATH = Path(__file__).resolve().parents[2] / "tools" / "count_step_kernels.py"
_spec = importlib.util.spec_from_file_location("count_step_kernels", _PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

HLO = """HloModule jit_step, is_scheduled=true

%fused_gmm (p.0: bf16[3,64,64]) -> bf16[64,64] {
  %d = bf16[64,64]{1,0} dynamic-slice(%p.0, %i, %j, %k), dynamic_slice_sizes={1,64,64}
  ROOT %k1 = bf16[64,64]{1,0} custom-call(%d), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/transpose(jvp(gmm))"}
}

%inner (p: (s32[], bf16[64,64])) -> (s32[], bf16[64,64]) {
  %f = bf16[64,64]{1,0} fusion(%s), kind=kCustom, calls=%fused_gmm
  ROOT %t2 = (s32[], bf16[64,64]{1,0}) tuple(%i, %f)
}

%body.1 (p: (s32[], bf16[64,64])) -> (s32[], bf16[64,64]) {
  %a = bf16[64,64]{1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/jvp(gmm)" source_file="x.py"}
  %b = bf16[64,64]{1,0} custom-call(%a), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI
  %w2 = (s32[], bf16[64,64]{1,0}) while(%init2), condition=%cond2, body=%inner, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %t = (s32[], bf16[64,64]{1,0}) tuple(%i, %b)
}

ENTRY %main.9 (x.1: bf16[64,64]) -> bf16[64,64] {
  %g = (f32[64,64]{1,0}, s8[1024]{0}) custom-call(%x.1, %x.1), custom_call_target="__cublas$lt$matmul"
  %c = bf16[64,64]{1,0} custom-call(%x.1), custom_call_target="mosaic_gpu_v2"
  %w = (s32[], bf16[64,64]{1,0}) while(%init), condition=%cond, body=%body.1, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_compiled_calls_follow_the_call_graph():
    """Each Mosaic custom-call with its op name and its executions per step: 3 in a while
    body run 3 times, 1 in the entry, and one in a fusion inside a loop of 2 inside that
    loop of 3 (6 runs). cuBLAS calls are not counted."""
    calls = sorted(tool._compiled_calls(HLO))
    assert calls == [
        ("body.1", "?", 3),
        ("body.1", "jit(step)/jvp(gmm)", 3),
        ("fused_gmm", "jit(step)/transpose(jvp(gmm))", 6),
        ("main.9", "?", 1),
    ]
    assert sum(r for _, _, r in calls) == 13


def test_kernel_calls_multiply_by_the_scan_length():
    """A kernel call inside a scan of length 3 counts 3 executions; outside it, one. A
    ``pallas_call`` stands in for the Mosaic kernels (which need a GPU to trace for real)."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    double = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                            interpret=True)

    def f(x):
        y = double(x)
        y, _ = jax.lax.scan(lambda c, _: (double(c), None), y, length=3)
        return y

    calls = tool._kernel_calls(jax.make_jaxpr(f)(jnp.ones((8, 128), jnp.float32)).jaxpr)
    assert sorted(m for _, m in calls) == [1, 3]
    assert sum(m for _, m in calls) == 4
