"""Kernel categorisation rules and the breakdown arithmetic, on synthetic names and events.

The names below are real kernel names in the forms CUPTI reports them
(cuBLAS ``sm90_xmma_*`` / ``nvjet_*``, CUTLASS templates, cuDNN flash
attention, NCCL) and XLA:CPU HLO instruction names.
"""

import math

import pytest

from dropless.perf import breakdown
from dropless.perf.breakdown import (ATTENTION, CATEGORIES, COMMUNICATION, COPY, DENSE_GEMM,
                                     GROUPED_GEMM, OTHER, QUANTIZATION, RULES, categorise)
from dropless.perf.trace import parse_events

CUTLASS_SM90 = ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int,"
                " int, int, int>, cutlass::gemm::collective::CollectiveMma<cutlass::gemm::"
                "MainloopSm90TmaGmmaWarpSpecialized<4, cute::tuple<cute::C<2>>>>>>")

# (kernel name, op text, expected category)
CASES = [
    # communication
    ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "", COMMUNICATION),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", "", COMMUNICATION),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "", COMMUNICATION),
    ("nvshmemi_transfer_kernel", "", COMMUNICATION),
    ("all-reduce.3", "all-reduce.3", COMMUNICATION),
    ("ragged-all-to-all.1", "ragged-all-to-all.1", COMMUNICATION),
    ("collective-permute-start.2", "", COMMUNICATION),
    ("MemcpyP2P", "", COMMUNICATION),
    ("recv-done.4", "", COMMUNICATION),
    # host <-> device copies
    ("MemcpyH2D", "", COPY),
    ("MemcpyD2H", "copy-start.1", COPY),
    ("Memcpy DtoH (Device -> Pinned)", "", COPY),
    # attention: precedence over the GEMM-looking words in its names
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
     "", ATTENTION),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "", ATTENTION),
    ("flash_attention_fwd_mosaic_gpu_kernel", "", ATTENTION),
    ("triton_softmax_fusion_3", "", ATTENTION),
    # FP8 quantization: our Pallas (Triton) kernels by name; XLA's quantize/amax fusions
    # by ops.quant's name scope or the f8-result tag of perf.hlo, also inside the gmm's scope
    ("_rows_kernel", "custom-call.7", QUANTIZATION),
    ("_columns_kernel", "", QUANTIZATION),
    ("_weight_kernel", "", QUANTIZATION),
    ("loop_convert_fusion_3", "command_buffer_2 jit(step)/jvp(mlp)/fp8_quantize/convert_element_type",
     QUANTIZATION),
    ("input_reduce_fusion_2", "command_buffer_2 jit(step)/jvp(gmm)/fp8_quantize/reduce_max",
     QUANTIZATION),
    ("loop_multiply_convert_fusion", "fusion.9 f8_result", QUANTIZATION),
    ("triton_kernel_call_3", "custom-call.3 jit(step)/jvp(gmm)/jit(quantize_columns)/pallas_call",
     QUANTIZATION),
    # the Mosaic GPU quantizers by their kernel_name (fp8_quant_mgpu), not as grouped GEMMs
    ("fp8_quantize_weight_mosaic_gpu_kernel", "custom-call.5", QUANTIZATION),
    ("fp8_quantize_rows_and_columns_mosaic_gpu_kernel", "", QUANTIZATION),
    ("fp8_swiglu_quantize_rows_mosaic_gpu_kernel", "custom-call.7", QUANTIZATION),
    # grouped GEMM: our kernels by name, XLA's ragged_dot by op
    ("gmm_mosaic_gpu_kernel", "custom-call.4", GROUPED_GEMM),
    ("body_mosaic_gpu_kernel", "command_buffer_25", GROUPED_GEMM),  # bf16 and FP8 Mosaic kernels
    ("gmm_fp8_mosaic_gpu_kernel", "", GROUPED_GEMM),
    ("tgmm_fp8_mosaic_gpu_kernel", "", GROUPED_GEMM),
    ("tgmm_mosaic_gpu_kernel", "", GROUPED_GEMM),
    ("main_kernel_mosaic_gpu", "", GROUPED_GEMM),
    ("tgmm_kernel", "", GROUPED_GEMM),
    ("ragged_dot_fusion", "", GROUPED_GEMM),
    ("grouped_gemm_bf16", "", GROUPED_GEMM),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN", "ragged-dot.1 transpose(jvp(experts))/ragged_dot_general",
     GROUPED_GEMM),
    ("loop_select_fusion", "select.2 jvp(gmm)/select_n", GROUPED_GEMM),
    # dense GEMM
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
     "segment_k_off_kernel__5x_cublas", "", DENSE_GEMM),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN", "dot.3 jvp(router)/dot_general", DENSE_GEMM),
    # FP8 dense GEMMs (cuBLASLt): never quantization, though their operands are FP8
    ("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_"
     "segment_k_off_kernel__5x_cublas", "", DENSE_GEMM),
    ("__cublas$lt$matmul$f8", "", DENSE_GEMM),
    ("nvjet_qqtst_128x256_128x4_2x1_v_bz_coopB_TNT", "cublas-gemm.2 jit(step)/jvp(mlp)/dot_general",
     DENSE_GEMM),
    (CUTLASS_SM90, "", DENSE_GEMM),  # "TmaGmma" is not "gmm"
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "", DENSE_GEMM),
    ("gemm_fusion_dot_12", "", DENSE_GEMM),
    ("dot.3", "dot.3", DENSE_GEMM),
    ("dot_general.35", "dot_general.35", DENSE_GEMM),
    ("ynn_fusion.8", "ynn_fusion.8", DENSE_GEMM),
    ("convolution.2", "", DENSE_GEMM),
    # other
    ("loop_add_fusion", "add.7", OTHER),
    ("input_reduce_fusion_3", "", OTHER),
    ("reduce_scatter_fusion", "", OTHER),  # XLA fusion name, not a collective
    ("convert_power_fusion", "", OTHER),  # "conv" of "convert"
    ("loop_convert_fusion", "convert.3 jit(step)/jvp(mlp)/convert_element_type", OTHER),  # bf16 cast
    ("MemcpyD2D", "", OTHER),
    ("Memset", "", OTHER),
    ("sort.3", "sort.3", OTHER),
    ("wrapped_scatter", "", OTHER),
    ("while.6", "while.6", OTHER),
]


@pytest.mark.parametrize("name,op,expected", CASES)
def test_categorise(name, op, expected):
    assert categorise(name, op) == expected


def test_every_category_and_rule_is_reached():
    """Each category has examples, and no rule is shadowed by an earlier one."""
    assert {c for _, _, c in CASES} == set(CATEGORIES)
    first_rule = set()
    for name, op, _ in CASES:
        first_rule.add(next(i for i, r in enumerate(RULES) if r.matches(name, op)))
    assert first_rule == set(range(len(RULES)))


def test_rules_end_with_catch_all():
    assert RULES[-1].category == OTHER and RULES[-1].matches("anything at all", "")
    assert all(r.category in CATEGORIES and r.field in ("kernel", "op") for r in RULES)


# ----------------------------------------------------------------------------
# Synthetic traces in the layout jax.profiler writes.


def _meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _x(pid, tid, event, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": event, "ts": ts, "dur": dur, "args": args}


def gpu_events():
    """Two GPU steps on one stream; a derived 'XLA Ops' line and host ops that must be ignored."""
    return [
        _meta(1, "/device:GPU:0"), _meta(1, "Stream #13(Kernel,MemcpyH2D)", 13),
        _meta(1, "XLA Ops", 99), _meta(701, "/host:CPU"), _meta(701, "python", 5),
        _x(701, 5, "train", 0.0, 40.0, step_num="0"),
        _x(701, 5, "train", 40.0, 40.0, step_num="1"),
        _x(701, 5, "fusion.1", 1.0, 2.0, hlo_op="fusion.1"),  # host-side thunk: not a kernel
        _x(1, 13, "MemcpyH2D", 10.0, 5.0),
        _x(1, 13, "gmm_mosaic_gpu_kernel", 20.0, 30.0, hlo_op="custom-call.1"),
        _x(1, 13, "sm90_xmma_gemm_bf16_cublas", 50.0, 10.0, hlo_op="dot.2"),
        _x(1, 13, "loop_add_fusion", 60.0, 5.0, hlo_op="add.1", name="jvp(mlp)/add"),
        _x(1, 13, "gmm_mosaic_gpu_kernel", 70.0, 30.0, hlo_op="custom-call.1"),
        _x(1, 99, "custom-call.1", 20.0, 30.0),  # the derived line repeats kernels
    ]


def test_parse_gpu_layout():
    trace = parse_events(gpu_events())
    assert trace.platform == "gpu" and trace.devices == ["/device:GPU:0"]
    assert [k.name for k in trace.kernels] == [
        "MemcpyH2D", "gmm_mosaic_gpu_kernel", "sm90_xmma_gemm_bf16_cublas", "loop_add_fusion",
        "gmm_mosaic_gpu_kernel"]
    assert trace.kernels[3].op == "add.1 jvp(mlp)/add"
    assert [s.step_num for s in trace.steps] == [0, 1]


def test_breakdown_arithmetic():
    bd = breakdown.compute(parse_events(gpu_events()), top=2)
    times = {c["category"]: c["time_us"] for c in bd.categories}
    assert times == {GROUPED_GEMM: 60.0, DENSE_GEMM: 10.0, ATTENTION: 0.0, QUANTIZATION: 0.0,
                     COMMUNICATION: 0.0,
                     COPY: 5.0, OTHER: 5.0}
    assert bd.kernel_us == 80.0
    # Wall: first step start (0) to the last kernel end (100), which is after the last step (80).
    assert bd.wall_us == 100.0 and bd.steps == 2
    assert bd.pct(GROUPED_GEMM) == pytest.approx(75.0)
    assert bd.pct(GROUPED_GEMM, "wall") == pytest.approx(60.0)
    assert math.isclose(sum(c["pct_kernel"] for c in bd.categories), 100.0)
    assert bd.busy_pct == pytest.approx(80.0)
    assert [k["name"] for k in bd.top_kernels] == ["gmm_mosaic_gpu_kernel",
                                                    "sm90_xmma_gemm_bf16_cublas"]
    assert bd.top_kernels[0]["count"] == 2 and bd.top_kernels[0]["avg_us"] == 30.0
    # Per category (top=2 each), with the op text that says what a fusion computes.
    assert {c: [k["name"] for k in ks] for c, ks in bd.top_by_category.items()} == {
        GROUPED_GEMM: ["gmm_mosaic_gpu_kernel"], DENSE_GEMM: ["sm90_xmma_gemm_bf16_cublas"],
        COPY: ["MemcpyH2D"], OTHER: ["loop_add_fusion"]}
    assert bd.top_by_category[OTHER][0]["op"] == "add.1 jvp(mlp)/add"
    assert bd.top_by_category[GROUPED_GEMM][0]["time_us"] == 60.0
    # Each launch's duration, in trace order, to tell launches of one kernel name apart.
    gmm = bd.top_by_category[GROUPED_GEMM][0]
    assert gmm["durations_us"] == [30.0, 30.0] and gmm["min_us"] == gmm["median_us"] == gmm["max_us"] == 30.0
    # ... and the HLO op each launch ran for (both launches here are custom-call.1).
    assert len(gmm["launch_ops"]["names"]) == 1 and gmm["launch_ops"]["names"][0].startswith("custom-call.1")
    assert gmm["launch_ops"]["index"] == [0, 0]


def test_launch_ops_tell_launches_of_one_name_apart():
    """Distinct op texts once each, in first-seen order; one index per launch."""
    from dropless.perf.breakdown import _launch_ops

    assert _launch_ops(["custom-call.1 jvp(moe)", "custom-call.7 transpose(jvp(moe))",
                        "custom-call.1 jvp(moe)"]) == {
        "names": ["custom-call.1 jvp(moe)", "custom-call.7 transpose(jvp(moe))"], "index": [0, 1, 0]}


def test_gpu_overlapping_kernels_count_in_full():
    """With programmatic dependent launch a kernel starts before the previous one ends."""
    events = [_meta(1, "/device:GPU:0"), _meta(1, "Stream #7(Kernel)", 7),
              _x(1, 7, "gmm_mosaic_gpu_kernel", 0.0, 100.0),
              _x(1, 7, "tgmm_mosaic_gpu_kernel", 90.0, 100.0),
              _x(1, 7, "loop_add_fusion", 95.0, 2.0)]
    trace = parse_events(events)
    assert [k.dur_us for k in trace.kernels] == [100.0, 100.0, 2.0]
    bd = breakdown.compute(trace)
    assert bd.kernel_us == 202.0 and bd.wall_us == 190.0
    assert bd.busy_pct == pytest.approx(100.0)


def test_cpu_nested_ops_count_exclusive_time():
    """A while thunk encloses its body's thunks: only its own time is counted."""
    events = [
        _meta(701, "/host:CPU"), _meta(701, "tf_XLAEigen/1", 7),
        _x(701, 7, "while.6", 0.0, 100.0, hlo_op="while.6"),
        _x(701, 7, "dot.1", 10.0, 30.0, hlo_op="dot.1"),
        _x(701, 7, "fusion.2", 50.0, 20.0, hlo_op="fusion.2"),
        _x(701, 7, "end: fusion.2", 70.0, 1.0, hlo_op="fusion.2"),  # completion marker
        _x(701, 7, "dot.9", 150.0, 10.0, hlo_op="dot.9"),
        _x(701, 7, "sort.2", 155.0, 10.0, hlo_op="sort.2"),  # overlaps dot.9, not inside it
    ]
    trace = parse_events(events)
    assert trace.platform == "cpu"
    durations = {k.name: k.dur_us for k in trace.kernels}
    assert durations == {"while.6": 50.0, "dot.1": 30.0, "fusion.2": 20.0, "dot.9": 10.0,
                         "sort.2": 10.0}
    bd = breakdown.compute(trace)
    assert bd.wall_us == 165.0  # no steps: span of the kernels
    assert any("no StepTraceAnnotation" in n for n in bd.notes)
    assert bd.pct(DENSE_GEMM) == pytest.approx(100 * 40 / 120)


def test_empty_trace_gives_zeros_and_a_note():
    bd = breakdown.compute(parse_events([_meta(701, "/host:CPU")]))
    assert bd.kernel_us == 0 and all(c["pct_kernel"] == 0 for c in bd.categories)
    assert any("no kernel time" in n for n in bd.notes)


def test_tables_plot_and_json(tmp_path):
    bd = breakdown.compute(parse_events(gpu_events()))
    cats, top = breakdown.tables(bd)
    assert cats.row_count == len(CATEGORIES) + 1 and top.row_count == 4
    breakdown.plot(bd, tmp_path / "b.png")
    breakdown.save(bd, tmp_path / "b.json", extra={"config": {"steps": 2}})
    import json

    data = json.loads((tmp_path / "b.json").read_text())
    assert data["config"] == {"steps": 2} and len(data["rules"]) == len(RULES)
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
