"""``perf.hlo``: kernel op text from optimized HLO, on HLO that XLA:CPU compiles here.

The quantizer's fusions must come out tagged (its name scope, and an f8
result for the convert), a bf16 -> f32 cast must not, and the categoriser
then counts the quantizer as quantization through ``breakdown.compute``. And the call
graph: how often each computation runs per step, loops and fusions included.
"""

from pathlib import Path

import jax
import jax.numpy as jnp

from dropless.ops import quant
from dropless.perf import breakdown, hlo
from dropless.perf.breakdown import F8_RESULT_TAG, QUANTIZATION
from dropless.perf.trace import KernelEvent, Trace

SAMPLE = """HloModule jit_step, entry_computation_layout={(bf16[8,8]{1,0})->f32[8,8]{1,0}}

ENTRY %main.3 (p: bf16[8,8]) -> (f8e4m3fn[8,8], f32[]) {
  %p = bf16[8,8]{1,0} parameter(0)
  %loop_convert_fusion.1 = f8e4m3fn[8,8]{1,0} fusion(%p), kind=kLoop, calls=%fc, metadata={op_name="jit(step)/fp8_quantize/convert_element_type"}
  %cast.2 = f32[8,8]{1,0} convert(%p), metadata={op_name="jit(step)/convert_element_type"}
  %gemm_fusion_dot.4 = f8e4m3fn[8,8]{1,0} fusion(%p, %p), kind=kCustom, calls=%gc
  %cublas-gemm.5 = (f8e4m3fn[8,8]{1,0}, s8[0]{0}) custom-call(%p, %p), custom_call_target="__cublas$lt$matmul$f8"
  ROOT %tuple.6 = (f8e4m3fn[8,8]{1,0}, f32[]) tuple(%loop_convert_fusion.1, %cast.2)
}
"""


def test_parse_sample():
    ops = hlo.parse(SAMPLE, F8_RESULT_TAG)
    assert hlo.module_name(SAMPLE) == "jit_step"
    assert hlo.entry_name(SAMPLE) == "main.3" and hlo.entry_name("HloModule m") == ""
    assert {i.computation for i in hlo.instructions(SAMPLE)} == {hlo.entry_name(SAMPLE)}
    quant_text = "jit(step)/fp8_quantize/convert_element_type " + F8_RESULT_TAG
    assert ops["loop_convert_fusion.1"] == ops["loop_convert_fusion_1"] == quant_text
    assert ops["cast_2"] == "jit(step)/convert_element_type"  # f32 result: not tagged
    # GEMMs writing FP8 are not tagged (Triton GEMM fusion, cuBLASLt custom call).
    assert "gemm_fusion_dot_4" not in ops and "cublas_gemm_5" not in ops
    assert "tuple_6" not in ops  # a tuple holding an f8 array is no quantization


def test_compiled_quantizer_is_quantization(tmp_path):
    def step(x):
        q, scale = quant.quantize_tensor(x)
        return q, scale, x.astype(jnp.float32) * 2

    text = jax.jit(step).lower(jnp.ones((16, 16), jnp.bfloat16)).compile().as_text()
    (tmp_path / "module_0001.jit_step.cpu_after_optimizations.txt").write_text(text)
    by_module = hlo.kernel_ops(tmp_path, F8_RESULT_TAG)
    ops = by_module[hlo.module_name(text)]
    tagged = [name for name, t in ops.items() if F8_RESULT_TAG in t]
    assert tagged, "the quantizer's convert to f8 was not found"
    assert any(breakdown.QUANT_SCOPE in t for t in ops.values())
    assert all(breakdown.categorise(n, ops[n]) == QUANTIZATION for n in tagged)
    # Through compute: a kernel named after a tagged instruction (no op in the trace,
    # as in a CUDA graph) counts as quantization.
    module = hlo.module_name(text)
    kernels = [KernelEvent(tagged[0], "command_buffer_1", module, 0.0, 3.0, "/device:GPU:0", "s"),
               KernelEvent("loop_add_fusion", "command_buffer_1", module, 3.0, 1.0,
                           "/device:GPU:0", "s")]
    bd = breakdown.compute(Trace("t", "gpu", kernels, [], ["/device:GPU:0"]), hlo_ops=by_module)
    assert bd.pct(QUANTIZATION) == 75.0
    assert breakdown.compute(Trace("t", "gpu", kernels, [], ["/device:GPU:0"])).pct(
        QUANTIZATION) == 0.0


def test_no_dump_is_empty(tmp_path):
    assert hlo.kernel_ops(tmp_path) == {}


# GPU-style text: custom-call operands by name only (types from their definitions in the
# same computation), a name reused with another type in a second computation, inline
# operand types, a custom-call without a target, and a `/*index=*/` comment in the operands.
OPERANDS = """HloModule m

%inner (p: bf16[8,32]) -> bf16[8,32] {
  ROOT %x = bf16[8,32]{1,0} parameter(0)
}

ENTRY %main (x: f8e4m3fn[8,32], w: f8e5m2[32,16]) -> f32[8,16] {
  %x = f8e4m3fn[8,32]{1,0} parameter(0)
  %w = f8e5m2[32,16]{1,0} parameter(1)
  %s = f32[] constant(1)
  %gemm = (f32[8,16]{1,0}, s8[64]{0}) custom-call(%x, %w, /*index=2*/%s, %later), custom_call_target="__cublas$lt$matmul$f8", backend_config={"note":"custom_call_target=\\"no\\""}
  %cc = f32[] custom-call(f32[] %s), backend_config={}
  ROOT %d = f32[8,16]{1,0} dot(bf16[8,32]{1,0} %a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_instruction_custom_call_target_and_operand_types():
    by_name = {i.name: i for i in hlo.instructions(OPERANDS)}
    inner_x = next(i for i in hlo.instructions(OPERANDS) if i.name == "x")
    assert inner_x.type == "bf16[8,32]{1,0}"  # the first %x, in %inner
    gemm, cc, d = by_name["gemm"], by_name["cc"], by_name["d"]
    assert gemm.custom_call_target == "__cublas$lt$matmul$f8"
    # By name, resolved in ENTRY (not %inner's bf16 %x); a name not defined there is "".
    assert gemm.operand_types == ["f8e4m3fn[8,32]{1,0}", "f8e5m2[32,16]{1,0}", "f32[]", ""]
    assert cc.custom_call_target is None and cc.operand_types == ["f32[]"]
    # Not a custom-call: no target; an inline type wins over the scope.
    assert d.custom_call_target is None
    assert d.operand_types == ["bf16[8,32]{1,0}", "f8e5m2[32,16]{1,0}"]


def test_result_types_of_tuple_and_plain_results():
    text = "\n".join([
        '  %g = (bf16[256,384]{1,0}, s8[4194304]{0}) custom-call(%a, %b), '
        'custom_call_target="__cublas$lt$matmul$f8"',
        "  %d = f32[8,16]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    ])
    g, d = hlo.instructions(text)
    assert g.result_types == ["bf16[256,384]{1,0}", "s8[4194304]{0}"]
    assert d.result_types == ["f32[8,16]{1,0}"]


LOOPS = """HloModule jit_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}

%fused_sum (p.0: f32[64,64]) -> f32[64] {
  %z = f32[] constant(0)
  ROOT %r = f32[64]{0} reduce(%p.0, %z), dimensions={1}, to_apply=%add
}

%fused_slice (p.1: bf16[3,64,64]) -> bf16[1,64,64] {
  ROOT %d = bf16[1,64,64]{2,1,0} dynamic-slice(%p.1, %i, %j, %k), dynamic_slice_sizes={1,64,64}
}

%inner (p: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {
  %f = f32[64]{0} fusion(%x), kind=kInput, calls=%fused_sum
  %k = bf16[64,64]{1,0} custom-call(%y), custom_call_target="mosaic_gpu_v2"
  ROOT %t2 = (s32[], f32[64,64]{1,0}) tuple(%i, %x)
}

%cond2 (p: (s32[], f32[64,64])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body.1 (p: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {
  %fs = ((bf16[3,64,64]{2,1,0}), bf16[1,64,64]{2,1,0}, u32[]) fusion-start(%w), kind=kLoop, calls=%fused_slice
  %fd = bf16[1,64,64]{2,1,0} fusion-done(%fs)
  %w2 = (s32[], f32[64,64]{1,0}) while(%init2), condition=%cond2, body=%inner, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %t = (s32[], f32[64,64]{1,0}) tuple(%i, %x)
}

ENTRY %main.9 (x.1: f32[64,64]) -> f32[64,64] {
  %c = f32[64,64]{1,0} copy(%x.1)
  %w = (s32[], f32[64,64]{1,0}) while(%init), condition=%cond, body=%body.1, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %g = f32[64,64]{1,0} get-tuple-element(%w), index=1
}
"""


def test_executions_multiply_the_known_trip_counts_of_nested_loops():
    """The entry runs once, the outer loop's body 3 times, the inner loop's 2 x 3 times, and
    what runs inside a kernel (a fusion's computation, a reduction's ``to_apply``, an async
    fusion's) as often as the instruction that calls it."""
    insts = list(hlo.instructions(LOOPS))
    runs = hlo.executions(insts)
    assert (runs["main.9"], runs["body.1"], runs["inner"], runs["cond2"]) == (1, 3, 6, 3)
    assert (runs["fused_slice"], runs["fused_sum"], runs["add"]) == (3, 6, 6)
    assert hlo.inner_computations(insts) == {"fused_sum", "add", "fused_slice"}


def test_step_summary_counts_per_run_of_the_step():
    """``tools/compile_step_for_gpu.summarize``: the Mosaic call in the inner loop runs 6
    times; the kernels are the entry's copy, the async slice (its start) 3 times and the
    inner loop's fusion and custom call 6 times each; not the inner loop's condition, the
    reduction's ``add`` or the bookkeeping."""
    from dropless.perf.bench import load_module

    tool = load_module("compile_step_for_gpu", Path(__file__).resolve().parents[2] / "tools")
    counts = tool.summarize(LOOPS)
    assert counts["mosaic_gpu_calls"] == 6 and counts["while_loops"] == 2
    assert counts["copies"] == 1
    assert counts["kernels"] == 1 + 3 + 6 + 6


COLLECTIVES = """HloModule jit_step, is_scheduled=true

%wrapped (a: f32[64]) -> f32[64] {
  ROOT %ar.1 = f32[64]{0} all-reduce(%a), replica_groups={{0,1}}, to_apply=%add
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %a2a-start = (f32[64]{0}, f32[64]{0}) ragged-all-to-all-start(%x, %y, %o, %s, %o2, %s2)
  %a2a-done = f32[64]{0} ragged-all-to-all-done(%a2a-start)
  %a2a = f32[64]{0} ragged-all-to-all(%x, %y, %o, %s, %o2, %s2)
  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %a2a)
}

ENTRY %main (x: f32[64]) -> f32[64] {
  %ag = f32[128]{0} all-gather(%x), dimensions={0}
  %as = ((f32[64]{0}), f32[64]{0}) async-start(%x), calls=%wrapped
  %ad = f32[64]{0} async-done(%as)
  %w = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r = f32[64]{0} get-tuple-element(%w), index=1
}
"""


def test_collectives_count_runs_and_the_asynchronous_ones():
    """Per run of the module: the loop's two ragged all-to-alls 4 times each, one of them a
    start/done pair; the all-reduce wrapped in ``async-start`` is asynchronous; the entry's
    all-gather runs once, synchronously."""
    counts = hlo.collectives(list(hlo.instructions(COLLECTIVES)))
    assert counts == {"ragged-all-to-all": (8, 4), "all-reduce": (1, 1), "all-gather": (1, 0)}


OVERLAP = """HloModule jit_step, is_scheduled=true

%fused (a: f32[64]) -> f32[64] {
  ROOT %n = f32[64]{0} negate(%a)
}

%wrapped (a: f32[64]) -> f32[64] {
  ROOT %ar.1 = f32[64]{0} all-reduce(%a), replica_groups={{0,1}}, to_apply=%add
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %a2a-start = (f32[64]{0}, f32[64]{0}) ragged-all-to-all-start(%x, %y, %o, %s, %o2, %s2)
  %f.1 = f32[64]{0} fusion(%x), kind=kLoop, calls=%fused
  %gte = f32[64]{0} get-tuple-element(%p), index=1
  %a2a-done = f32[64]{0} ragged-all-to-all-done(%a2a-start)
  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %a2a-done)
}

ENTRY %main (x: f32[64]) -> f32[64] {
  %as = ((f32[64]{0}), f32[64]{0}) async-start(%x), calls=%wrapped
  %ag-start = (f32[64]{0}, f32[128]{0}) all-gather-start(%x), dimensions={0}
  %f.2 = f32[64]{0} fusion(%x), kind=kLoop, calls=%fused
  %ag-done = f32[128]{0} all-gather-done(%ag-start)
  %f.3 = f32[64]{0} fusion(%x), kind=kLoop, calls=%fused
  %cc = f32[64]{0} custom-call(%x), custom_call_target="__cublas$gemm"
  %ad = f32[64]{0} async-done(%as)
  %ag = f32[128]{0} all-gather(%x), dimensions={0}
  %w = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r = f32[64]{0} get-tuple-element(%w), index=1
}
"""


def test_overlap_counts_the_kernels_between_each_start_and_done():
    """The all-reduce (wrapped in ``async-start``) has three kernels scheduled beside it: two
    fusions and a GEMM; the all-gather's own start is a collective, not compute, so the
    all-gather beside it overlaps one fusion; the loop's all-to-all overlaps one fusion in each
    of its 4 iterations (the get-tuple-element launches nothing); the synchronous all-gather
    has no entry."""
    insts = list(hlo.instructions(OVERLAP))
    assert hlo.overlap(insts) == {"all-reduce": [3], "all-gather": [1], "ragged-all-to-all": [1] * 4}
    launched = {i.name for i in hlo.launches(insts)}
    # The all-reduce launches once: as itself, not again as the async-start wrapping it.
    assert launched == {"ag-start", "f.2", "f.3", "cc", "ag", "a2a-start", "f.1", "ar.1"}
