"""The MoE layer benchmark on its tiny shape: FLOP formula, the split's pieces, the record."""

import importlib.util
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_module("moe_layer", REPO / "benchmarks")


def test_expert_flops_match_torchtitans_figure(bench):
    """torchtitan: 43.6 ms fwd+bwd is 447 TF/s on this shape, counting expert FLOPs."""
    flops = bench.expert_flops(bench.FULL)
    assert flops["fwd_bwd"] == 3 * flops["fwd"]
    assert flops["fwd"] == 6 * 8192 * (8 + 1) * 7168 * 2048
    assert round(flops["fwd_bwd"] / 43.6e-3 / 1e12) == 447


def test_pieces_compose_to_the_block(bench):
    """The split times the block's own code: the pieces, chained, give the block's output."""
    layer = bench.Layer(bench.TINY, bench.moe_config(bench.TINY, gmm_backend="xla"))
    pieces = bench.split_pieces(layer)
    assert list(pieces) == ["router", "permute", "gmm", "combine", "shared"]
    y_block, _ = layer.fwd(layer.params, layer.rest, layer.x)
    y_pieces = bench.compose_forward(layer, pieces)
    np.testing.assert_allclose(np.asarray(y_pieces, np.float32), np.asarray(y_block, np.float32),
                               rtol=2e-2, atol=2e-2)
    # Each fwd+bwd piece returns gradients for every differentiable input.
    _, (fn, args) = pieces["gmm"]
    out, _, grads = fn(*args)
    assert out.shape == (bench.TINY["batch"] * bench.TINY["seq"] * bench.TINY["top_k"],
                         bench.TINY["emb_dim"])
    assert len(grads) == 2 and grads[1].dtype == jnp.bfloat16
    capacity = bench.Layer(bench.TINY, bench.moe_config(bench.TINY, sparse_matmul=False))
    with pytest.raises(ValueError, match="sparse_matmul"):
        bench.split_pieces(capacity)


def test_run_writes_a_record(bench, tmp_path):
    record = bench.run(quick=True, out_dir=tmp_path, tiny=True, cases=["ours", "capacity-1.0"])
    saved = json.loads(Path(record["path"]).read_text())
    assert saved["kind"] == "moe_layer" and saved["versions"]["jax"]
    assert saved["device"]["gpu"] and saved["commit"]["commit"]
    assert [r["case"] for r in saved["rows"]] == ["ours", "capacity-1.0"]
    ours, capacity = saved["rows"]
    assert ours["fwd_ms"] > 0 and ours["fwd_bwd_ms"] > 0 and ours["dropped_fraction"] == 0
    assert capacity["backend"] == "dense_matmul" and capacity["capacity_factor"] == 1.0
    flops = bench.expert_flops(bench.TINY)
    assert math.isclose(ours["fwd_tflops"], flops["fwd"] / ours["fwd_ms"] / 1e9)
    split = saved["split"]
    assert [p["piece"] for p in split["pieces"]] == ["router", "permute", "gmm", "combine", "shared"]
    routing = sum(p["fwd_bwd_ms"] for p in split["pieces"] if p["piece"] in bench.ROUTING_PIECES)
    assert math.isclose(split["routing_share_fwd_bwd_pct"], 100 * routing / ours["fwd_bwd_ms"])
    bd = saved["kernel_breakdown"]
    assert bd["steps"] == 3 and math.isclose(sum(c["pct_kernel"] for c in bd["categories"]), 100)
    with pytest.raises(ValueError, match="unknown cases"):
        bench.run(tiny=True, out_dir=tmp_path, cases=["nope"])


def test_qwen3_30b_shape_has_softmax_routing_and_no_shared_piece(bench):
    """--shape qwen3-30b: Qwen3-30B-A3B's layer; without a shared expert the split has
    no shared piece and the pieces still compose to the block (same bf16 tolerance)."""
    assert bench.SHAPES["qwen3-30b"]["num_experts"] == 128 and bench.SHAPES["qwen3-30b"]["moe_mlp_dim"] == 768
    cfg = bench.moe_config(bench.QWEN3_30B)
    assert cfg.routed_score_func == "softmax" and not cfg.routed_bias and cfg.shared_experts == 0
    tiny = {**bench.TINY, "shared_experts": 0}
    layer = bench.Layer(tiny, bench.moe_config(bench.TINY, gmm_backend="xla", shared_experts=0))
    pieces = bench.split_pieces(layer)
    assert "shared" not in pieces
    y_block, _ = layer.fwd(layer.params, layer.rest, layer.x)
    np.testing.assert_allclose(np.asarray(bench.compose_forward(layer, pieces), np.float32),
                               np.asarray(y_block, np.float32), rtol=2e-2, atol=2e-2)


def test_torch_cases_run_first_and_say_when_torch_is_missing(bench, tmp_path):
    """A torch case without torch is an error row that names torch; with torch it is timed.
    Either way it comes before jax's cases, whatever order they are given in."""
    record = bench.run(quick=True, out_dir=tmp_path, tiny=True, trace=False,
                       cases=["capacity-1.0", "torch_grouped_mm"])
    torch_row, capacity = record["rows"]
    assert torch_row["case"] == "torch_grouped_mm" and capacity["case"] == "capacity-1.0"
    if importlib.util.find_spec("torch") is None:
        assert "torch" in torch_row["error"] and record["torch_speedup"] == {}
    else:
        assert torch_row["fwd_bwd_ms"] > 0
        speedup = record["torch_speedup"]["capacity-1.0"]["fwd_bwd"]
        assert math.isclose(speedup, torch_row["fwd_bwd_ms"] / capacity["fwd_bwd_ms"])


def test_torch_speedups_are_the_torch_time_over_the_case_time(bench):
    rows = [{"case": "torch_grouped_mm", "fwd_ms": 4.0, "fwd_bwd_ms": 12.0},
            {"case": "torchtitan_ref", "fwd_ms": 5.0, "fwd_bwd_ms": 15.0},
            {"case": "ours", "fwd_ms": 2.0, "fwd_bwd_ms": 8.0},
            {"case": "xla", "error": "boom"},
            {"case": "capacity-1.0", "fwd_ms": 8.0, "fwd_bwd_ms": None}]
    assert bench.torch_speedups(rows) == {"ours": {"fwd": 2.0, "fwd_bwd": 1.5},
                                          "capacity-1.0": {"fwd": 0.5, "fwd_bwd": None}}
    assert bench.torch_speedups(rows[2:]) == {}


def test_large_copies_reads_copy_instructions_and_their_sizes(bench):
    """Only copy / copy-start results of at least the threshold, sized from dtype and dims."""
    hlo = "\n".join([
        "  %copy.3 = bf16[65536,7168]{1,0} copy(bf16[65536,7168]{0,1} %p0)",
        "  copy-start.1 = (f32[32,7168,4096]{2,1,0}, f32[32,7168,4096]{2,1,0}, u32[]) "
        "copy-start(f32[32,7168,4096]{2,1,0} %w)",
        "  %copy.4 = bf16[128,128]{1,0} copy(bf16[128,128]{0,1} %p1)",
        "  %add.1 = bf16[65536,7168]{1,0} add(%a, %b)",
        "  ROOT %copy.9 = f8e4m3fn[4096,65536]{1,0} copy(%q)",
    ])
    copies = bench.large_copies(hlo)
    assert [(c["name"], c["op"], c["mib"]) for c in copies] == [
        ("copy-start.1", "copy-start", 3584.0), ("copy.3", "copy", 896.0), ("copy.9", "copy", 256.0)]
    assert bench.large_copies(hlo, min_bytes=1)[-1]["name"] == "copy.4"


def test_dump_hlo_writes_the_compiled_fwd_bwd(bench, tmp_path):
    import gzip

    layer = bench.Layer(bench.TINY, bench.moe_config(bench.TINY, gmm_backend="xla"))
    out = bench.dump_hlo(layer, tmp_path / "hlo" / "moe.txt.gz")
    text = gzip.open(out["path"], "rt").read()
    assert text.startswith("HloModule") and "ENTRY" in text
    assert isinstance(out["large_copies"], list)



def _elements(hlo_type: str) -> int:
    """Elements of an HLO array type such as ``bf16[8,128,64]{2,1,0}``."""
    dims = hlo_type[hlo_type.index("[") + 1:hlo_type.index("]")]
    return math.prod(int(d) for d in dims.split(",") if d)


def _largest_dot_bytes(layer) -> int:
    """The most bytes one ``dot`` of the layer's fwd+bwd reads and writes, in bf16, from
    the HLO that jax lowers on this CPU: there ``lax.ragged_dot`` becomes jax's own masked
    dense product over the groups, the expansion XLA:GPU makes too (in the H200 log the
    weight gradient's dot read bf16[128,131072,2048] and bf16[128,131072,1536]). The
    operands are bf16; the result is counted in bf16 too: the dot accumulates in float32
    and on the GPU the conversion to bf16 is fused into the GEMM (that log's
    ``gemm_fusion_dot.4``)."""
    from dropless.perf import hlo

    text = layer.fwd_bwd.lower(layer.params, layer.rest, layer.x, layer.g).as_text(dialect="hlo")
    return max(2 * (_elements(inst.type) + sum(_elements(inst.scope[name])
                                               for _, name in inst.operands))
               for inst in hlo.instructions(text) if inst.opcode == "dot")


@pytest.mark.parametrize("prefuse", [True, False])
def test_ragged_dot_bound_is_the_largest_dot_of_the_xla_layer(bench, prefuse):
    """The bound is the weight gradient's dot (its two masked dense operands and its
    result): the largest dot of the xla layer's fwd+bwd, for gate|up fused or not. F is
    48 so that gate|up (K = D = 64, N = 96 fused) and down (K = 48, N = 64) differ."""
    shape = {**bench.TINY, "moe_mlp_dim": 48}
    cfg = bench.moe_config(shape, gmm_backend="xla", prefuse_moe_weights=prefuse)
    assert bench.ragged_dot_fwd_bwd_bytes(shape, cfg) == _largest_dot_bytes(bench.Layer(shape, cfg))


def test_ragged_dot_bound_is_what_xla_reported_at_qwen3_30b(bench):
    """On the H200, XLA's scheduler printed "The byte size of input/output arguments
    (121064390656)" for the Qwen3-30B weight gradient's dot
    (benchmarks/results/logs/moe-layer-qwen3-oom-20261202-1643-h200.log)."""
    cfg = bench.moe_config(bench.QWEN3_30B, **bench.CASES["xla"])
    assert bench.ragged_dot_fwd_bwd_bytes(bench.QWEN3_30B, cfg) == 121064390656


@pytest.fixture
def h200_bytes():
    """What JAX's allocator may take of an H200 (141 GB: 143771 MiB) at its default
    memory fraction, 0.75: the setting moe_layer.py runs under."""
    from dropless.perf import memory

    return memory.target("h200", env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75"}).usable_bytes


@pytest.fixture
def hopper(bench, monkeypatch):
    """gmm_backend=auto resolves as on a Hopper GPU (to the Mosaic kernels), not as on this CPU
    (to xla)."""
    monkeypatch.setattr(bench, "resolve_backend", lambda backend, *_: "mosaic" if backend == "auto"
                        else backend)


def test_only_qwen3_30bs_xla_case_is_skipped_on_an_h200(bench, h200_bytes, hopper):
    skipped = bench.skip_row("xla", bench.QWEN3_30B, h200_bytes)
    assert skipped["case"] == "xla" and skipped["backend"] == "xla"
    assert skipped["estimate_bytes"] == 121064390656 and skipped["device_bytes"] == h200_bytes
    assert skipped["skipped"] == ("fwd+bwd needs >= 112.8 GiB (ragged_dot's dense operands), "
                                  "device allows 105.3 GiB")
    assert [n for n in bench.CASES if bench.skip_row(n, bench.QWEN3_30B, h200_bytes)] == ["xla"]
    assert not [n for n in bench.CASES if bench.skip_row(n, bench.FULL, h200_bytes)]
    # Where the device reports no limit (CPU), nothing is skipped.
    assert bench.skip_row("xla", bench.QWEN3_30B, None) is None


def test_a_skipped_case_is_recorded_printed_and_not_compiled(bench, h200_bytes, hopper, tmp_path,
                                                              capsys, monkeypatch):
    """run() at the Qwen3-30B shape on an H200-sized device: the xla case gets one line, a
    row with the reason in the record and in the table, and is never built or compiled."""
    import io

    from rich.console import Console

    def never(*_):
        raise AssertionError("a skipped case must not be built")

    monkeypatch.setattr(bench, "time_case", never)
    record = bench.run(quick=True, out_dir=tmp_path, shape_name="qwen3-30b", cases=["xla"],
                       trace=False, device_bytes=h200_bytes)
    line = ("skipping xla: fwd+bwd needs >= 112.8 GiB (ragged_dot's dense operands), "
            "device allows 105.3 GiB")
    assert line in capsys.readouterr().out
    (row,) = json.loads(Path(record["path"]).read_text())["rows"]
    assert row["case"] == "xla" and row["skipped"] in line and "fwd_bwd_ms" not in row
    assert record["torch_speedup"] == {}
    out = io.StringIO()
    bench.print_tables(record, console=Console(file=out, width=200))
    assert "skipped: fwd+bwd needs >= 112.8 GiB" in out.getvalue()
