"""tools/count_step_kernels.py: its two counts on CPU (cuDNN attention included), and its
reading of optimized HLO text."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

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


@pytest.fixture
def cudnn_traceable(monkeypatch):
    """jax traces cuDNN attention only where it finds the cuDNN library (not on this CPU);
    claiming cuDNN 9.10 lets it trace, and lower for CUDA, the same custom calls as on a GPU."""
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)


def test_lowering_keeps_cudnn_attention(cudnn_traceable):
    """cuDNN attention's custom call, which ``jax.export`` refuses (no compatibility
    guarantee: the GPU failure of count-step-kernels-scan-export-fails-20261202-1035-h200.log),
    lowers for CUDA and stays in the text."""
    x = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    attend = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"))
    with pytest.raises(ValueError, match="no compatibility guarantees"):
        jax.export.export(attend, platforms=["cuda"])(x, x, x)
    assert "@__cudnn$fmhaSoftmax(" in tool.lowered_for_cuda(attend, x, x, x)


def test_main_on_a_step_with_cudnn_attention(cudnn_traceable, capsys):
    """The whole tool on CPU for the tiny model with cuDNN attention, its output lines as
    before: the jaxpr's total and a ``lowered:`` line per Mosaic call of the CUDA lowering."""
    assert tool.main(["model_name=deepseek3-tiny", "gmm_backend=mosaic", "dtype=bfloat16",
                      "attention=cudnn_flash_te"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "jaxpr: 18 kernel executions per step" in out
    lowered = [line for line in out if line.startswith("lowered: in while#")]
    assert len(lowered) == 6 and all(", read by " in line for line in lowered)
