"""benchmarks/fp8_dense.py on the tiny preset: the matmul list, the record, and the FP8 numerics."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import quant
from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_module("fp8_dense", REPO / "benchmarks")


@pytest.fixture(scope="module")
def record(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_dense")
    # fp8_min_dim=0: every matmul FP8 in the model (the default 4096 is above all tiny dims).
    assert bench.main(["--tiny", "--iters", "1", "--warmup", "0", "--reps", "1",
                       "--out", str(out), "fp8_min_dim=0"]) == 0
    (path,) = out.glob("fp8_dense-*.json")
    return json.loads(path.read_text())


def test_record_has_the_tiny_presets_matmuls_and_layer_counts(bench, record):
    """Shapes from deepseek3-tiny's dims (D 64, Lq 32, H 4, N+R 24, Lkv 32, R 8, N+V 32, V 16,
    F 128, shared 1 x 64, vocab 256); counts from its 4 layers (1 dense, 3 MoE, no MTP)."""
    c = bench.resolve(bench.TINY_BASE)
    d, h = c.emb_dim, c.num_query_heads
    assert (d, h, c.q_lora_rank, c.kv_lora_rank, c.mlp_dim, c.moe_mlp_dim, c.vocab_size) == \
        (64, 4, 32, 32, 128, 64, 256)
    q, kv_up = c.qk_nope_head_dim + c.qk_rope_head_dim, c.qk_nope_head_dim + c.v_head_dim
    want = {
        "mla.wq_a": (d, c.q_lora_rank, 4), "mla.wq_b": (c.q_lora_rank, h * q, 4),
        "mla.wkv_a": (d, c.kv_lora_rank + c.qk_rope_head_dim, 4),
        "mla.wkv_b": (c.kv_lora_rank, h * kv_up, 4), "mla.wo": (h * c.v_head_dim, d, 4),
        "mlp.wi_0": (d, c.mlp_dim, 1), "mlp.wi_1": (d, c.mlp_dim, 1), "mlp.wo": (c.mlp_dim, d, 1),
        "shared.wi_0": (d, c.moe_mlp_dim, 3), "shared.wi_1": (d, c.moe_mlp_dim, 3),
        "shared.wo": (c.moe_mlp_dim, d, 3), "head.head": (d, c.vocab_size, 1),
    }
    got = {r["name"]: (r["K"], r["N"], r["count"]) for r in record["rows"]}
    assert got == want
    assert record["kind"] == "fp8_dense"
    assert record["config"]["overrides"] == [*bench.TINY_BASE, "fp8_min_dim=0"]
    assert record["config"]["fp8_min_dim"] == 0
    assert record["config"]["tokens"] == int(c.per_device_batch_size) * c.max_target_length == 1024
    assert [r["fp8_in_model"] for r in record["rows"]] == [True] * 11 + [False]


def test_mtp_adds_a_layer_and_a_head_call(bench):
    rows = bench.matmuls(bench.resolve([*bench.TINY_BASE, "mtp_num_layers=1"]))
    counts = {r["name"]: r["count"] for r in rows}
    assert counts["mla.wq_a"] == 5 and counts["shared.wo"] == 4 and counts["mlp.wo"] == 1
    assert counts["head.head"] == 2


def test_min_dim_marks_the_narrow_matmuls_bf16_in_the_model(bench):
    """With fp8_min_dim, a matmul with K or N below it is not FP8 in the model (the totals
    "as configured" then time it in bf16)."""
    rows = bench.matmuls(bench.resolve([*bench.TINY_BASE, "quantization=te_fp8_currentscaling",
                                        "fp8_min_dim=64"]))
    assert rows and all(r["fp8_in_model"] == (min(r["K"], r["N"]) >= 64 and r["group"] != "head")
                        for r in rows)
    assert any(not r["fp8_in_model"] and r["group"] != "head" for r in rows)
    # The default (4096) is above every dim of deepseek3-tiny: none is FP8 in the model.
    rows = bench.matmuls(bench.resolve([*bench.TINY_BASE, "quantization=te_fp8_currentscaling"]))
    assert rows and not any(r["fp8_in_model"] for r in rows)


def test_record_rows_are_fp8_in_hlo_and_consistent(record):
    """FP8 rows carry E4M3 and E5M2 in their optimized HLO, bf16 rows none; each fwd+bwd has
    3 dots. XLA:CPU converts the FP8 codes to float before its dot (0 FP8-operand dots
    there); on the GPU all 3 must take FP8 operands (cuBLASLt FP8 GEMMs)."""
    gpu = record["device"]["platform"] == "gpu"
    for r in record["rows"]:
        assert "error" not in r, r
        b, f = r["bf16"], r["fp8"]
        assert f["f8e4m3"] and f["f8e5m2"], r["name"]
        assert not (b["f8e4m3"] or b["f8e5m2"]) and b["f8_dots"] == 0, r["name"]
        assert b["dots"] == 3 and f["dots"] == 3 and f["hlo_check"] == 2, r["name"]
        assert f["f8_dots"] == (3 if gpu else 0), r["name"]
        assert f["finite_y"] and f["finite_dx"] and f["finite_dw"]
        # bf16 vs bf16-fallback differ by at most ~2 x 2^-8 relative; FP8 (E4M3, u = 2^-4)
        # must differ by more, or it did not round to FP8.
        assert 1e-2 < f["rel_err_y"] < 0.1, (r["name"], f["rel_err_y"])
        assert r["speedup_fwd_bwd"] == pytest.approx(b["fwd_bwd_ms"] / f["fwd_bwd_ms"])
        assert b["step_ms"] == pytest.approx(r["count"] * b["fwd_bwd_ms"])
    tot = record["totals"]
    assert sum(r["share_bf16_pct"] for r in record["rows"]) == pytest.approx(100)
    assert tot["step_ms_bf16"] == pytest.approx(sum(r["bf16"]["step_ms"] for r in record["rows"]))
    head = record["rows"][-1]
    assert tot["step_ms_fp8_as_configured"] == pytest.approx(
        tot["step_ms_fp8_all"] - head["fp8"]["step_ms"] + head["bf16"]["step_ms"])


def _fp8_error_bound(a, b, ua, ub, half_sub_a, half_sub_b):
    """Elementwise bound on |fl(q(a) . q(b)) - a . b| (float64 a [M, K], b [K, N]).

    Each quantized operand q(a) = a + e, |e| <= u|a| + half the subnormal spacing x its
    per-tensor scale (E4M3: u 2^-4, spacing 2^-9; E5M2: u 2^-3, spacing 2^-16). Then
    |q(a).q(b) - a.b| <= ea.|b| + |a|.eb + ea.eb; the float32 accumulation adds at most
    K 2^-24 |q(a)|.|q(b)|, the scale product 2^-22 relative, and the bf16 output 2^-8 of |y|.
    """
    ea = ua * np.abs(a) + half_sub_a
    eb = ub * np.abs(b) + half_sub_b
    pre = ea @ np.abs(b) + np.abs(a) @ eb + ea @ eb
    big = (np.abs(a) + ea) @ (np.abs(b) + eb)
    pre = pre + (a.shape[1] * 2.0**-24 + 2.0**-22) * big
    return pre + 2.0**-8 * (np.abs(a @ b) + pre)


@pytest.mark.parametrize("k,n", [(32, 128), (64, 256)])
def test_fp8_linear_within_derived_bound(bench, k, n):
    """The FP8 nnx.Linear's y, dx, dw against float64 products of the same bf16 inputs."""
    cfg = bench.resolve([*bench.TINY_BASE, "per_device_batch_size=2"])
    dtype = jnp.dtype(cfg.dtype)
    w, x, dy = bench.inputs(2, cfg.max_target_length, k, n, dtype, dtype, seed=3)
    _, fwd_bwd = bench.linear_fns(k, n, bench.FP8, dtype, dtype)
    y, dx, dw = (np.asarray(v, np.float64) for v in jax.jit(fwd_bwd)(w, x, dy))
    x2, w2 = np.asarray(x, np.float64).reshape(-1, k), np.asarray(w, np.float64)
    dy2 = np.asarray(dy, np.float64).reshape(-1, n)

    def half_sub(v, dtype):
        spacing = 2.0**-9 if dtype == quant.E4M3 else 2.0**-16
        return spacing / 2 * float(quant.quantize_tensor(jnp.asarray(v), dtype)[1])

    e4, e5 = 2.0**-4, 2.0**-3
    hx, hw, hg = half_sub(x2, quant.E4M3), half_sub(w2, quant.E4M3), half_sub(dy2, quant.E5M2)
    checks = {
        "y": (y.reshape(-1, n), x2 @ w2, _fp8_error_bound(x2, w2, e4, e4, hx, hw)),
        "dx": (dx.reshape(-1, k), dy2 @ w2.T, _fp8_error_bound(dy2, w2.T, e5, e4, hg, hw)),
        "dw": (dw, x2.T @ dy2, _fp8_error_bound(x2.T, dy2, e4, e5, hx, hg)),
    }
    for name, (got, ref, bound) in checks.items():
        excess = np.abs(got - ref) - bound
        assert excess.max() <= 0, (name, excess.max())
        # Not bf16 in disguise: FP8 rounding shows (relative error well above bf16's 2^-8).
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) > 1e-2, name


def test_bad_override_is_one_line_exit_2(bench, capsys):
    assert bench.main(["--tiny", "no_such_key=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err
