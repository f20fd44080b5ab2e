"""FP8 in the layers: MoEBlock grouped-GEMM recipes and ``te_fp8_currentscaling`` dense projections.

Each quantized layer is compared with the same layer (same parameters,
same input) unquantized: outputs and gradients must be close in relative
Frobenius norm and must differ (the quantization is really applied). The
expected size: E4M3 rounding is uniform within +-2^-4 relative, RMS about
2^-4/sqrt(3) = 3.6% per element; a product of two such operands with
random-sign terms has about sqrt(2) x 3.6% = 5% relative error whatever its
length, gradients through E5M2 (RMS 7%) about 8%. Errors compound through a
layer: the MLP's first-layer weight gradient passes an E5M2 cotangent through
the FP8 dgrad of wo and then an E5M2 wgrad, about sqrt(2 x 7^2 + 3.6^2) = 10%,
so its bound sits well above that mean (a bound of 0.1 sat on the mean, 9.5%,
and failed on some seeds). The router's gradient is a difference of expert outputs and has
a heavy tail (MoE, 60 seeds: mean 8%, max 14%). Bounds below were set from
the spread over 40-60 seeds with about 1.5x margin or more over the worst. The
ops-level tests hold the exact numerics; these check the wiring.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dropless.config.sections import MLAConfig, ModelConfig, MoEConfig
from dropless.nn import moe as moe_lib
from dropless.nn.mlp import MLP
from dropless.config.loader import load_config
from dropless.nn.model import Transformer, bf16_dense_matmuls, bf16_dense_matmuls_line
from dropless.ops import fp8_dot
from dropless.ops.gmm import quantized

D = 64
MOE = MoEConfig(num_experts=4, num_experts_per_tok=2, moe_mlp_dim=64, shared_experts=1,
                routed_score_func="sigmoid", gmm_backend="xla")


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _named_leaves(tree):
    return {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(tree))[0]}


def _loss_and_grads(module, x, c):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    @jax.jit
    def run(params, x):
        def loss(params, x):
            out = nnx.merge(graphdef, params, rest)(x)
            y = out[0] if isinstance(out, tuple) else out
            return jnp.sum(y.astype(jnp.float32) * c), y
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    (_, y), (g_params, g_x) = run(params, x)
    return y, _named_leaves(g_params), g_x


def _compare(quantized_module, plain_module, x, rng, *, y_tol, grad_tol, extra_tol=None):
    """Relative errors of output, input gradient and every parameter gradient.

    ``extra_tol`` maps a substring of a parameter's path to its own bound.
    """
    c = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    yq, gq, gxq = _loss_and_grads(quantized_module, x, c)
    y0, g0, gx0 = _loss_and_grads(plain_module, x, c)
    assert gq.keys() == g0.keys()
    errs = {"y": _rel(yq, y0), "dx": _rel(gxq, gx0)}
    errs.update({f"d{name}": _rel(gq[name], g0[name]) for name in g0})
    for name, err in errs.items():
        bound = y_tol if name == "y" else grad_tol
        for part, tol in (extra_tol or {}).items():
            if part in name:
                bound = tol
        assert err < bound, f"{name}: relative error {err:.3g} (bound {bound})"
    assert errs["y"] > 1e-4, "the quantized layer computes exactly the plain one"
    return errs


@pytest.mark.parametrize("recipe", ["te_mxfp8", "te_fp8_blockwise"])
def test_moe_block_recipe_close_to_unquantized(recipe, rng, monkeypatch):
    seen = []
    real_gmm = quantized.gmm

    def recording_gmm(x, w, group_sizes, **kw):
        if kw["recipe"] == recipe:  # (the unquantized block passes te_no_quant)
            jax.debug.callback(lambda gs: seen.append(np.asarray(gs)), group_sizes)
        return real_gmm(x, w, group_sizes, **kw)

    monkeypatch.setattr(quantized, "gmm", recording_gmm)
    block_q = moe_lib.MoEBlock(dataclasses.replace(MOE, gmm_quantization=recipe), emb_dim=D,
                               rngs=nnx.Rngs(3))
    block_0 = moe_lib.MoEBlock(MOE, emb_dim=D, rngs=nnx.Rngs(3))
    x = jnp.asarray(rng.standard_normal((2, 24, D)), jnp.float32)
    # Measured over 60 seeds (te_mxfp8): y 4.6% (max 5.1%), expert and shared
    # gradients 8% (max 9%), router gradient 8% (max 14%).
    errs = _compare(block_q, block_0, x, rng, y_tol=0.08, grad_tol=0.15,
                    extra_tol={"router": 0.25})
    assert max(errs.values()) > 1e-3
    align = quantized.required_alignment(recipe)
    assert moe_lib.group_alignment(block_q.cfg) == align
    # Both grouped matmuls saw group sizes padded to the recipe's blocks.
    assert len(seen) >= 2 and all(np.all(gs % align == 0) and gs.sum() >= 2 * 24 * 2
                                  for gs in seen)


def test_group_alignment_takes_the_max():
    cfg = dataclasses.replace(MOE, gmm_quantization="te_mxfp8", group_alignment=64)
    assert moe_lib.group_alignment(cfg) == 64
    assert moe_lib.group_alignment(dataclasses.replace(cfg, group_alignment=8)) == 32
    assert moe_lib.group_alignment(MOE) == 1


def test_mlp_fp8_close_to_plain(rng):
    mlp_q = MLP(D, 96, rngs=nnx.Rngs(1), dot_general=fp8_dot.fp8_dot_general)
    mlp_0 = MLP(D, 96, rngs=nnx.Rngs(1))
    assert mlp_q.wi_0.dot_general is fp8_dot.fp8_dot_general
    x = jnp.asarray(rng.standard_normal((3, 10, D)), jnp.float32)
    # Measured over 40 seeds: y 6.6% (max 7.4%), gradients 8-9.5% (max 10.3%).
    _compare(mlp_q, mlp_0, x, rng, y_tol=0.11, grad_tol=0.16)


SMALL = ModelConfig(
    vocab_size=32, emb_dim=32, num_decoder_layers=2, first_num_dense_layers=1, mlp_dim=64,
    mla=MLAConfig(num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8),
    moe=dataclasses.replace(MOE, moe_mlp_dim=32),
)


def _dot_generals(model):
    """{path: dot_general} of every nnx.Linear in the model."""
    return {"/".join(map(str, path)): node.dot_general for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Linear)}


@pytest.mark.parametrize("head", [False, True])
def test_transformer_currentscaling_wiring(head):
    cfg = dataclasses.replace(SMALL, quantization="te_fp8_currentscaling", quantize_output_head=head,
                              fp8_min_dim=0)
    fns = _dot_generals(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    fp8 = {p for p, f in fns.items() if f is fp8_dot.fp8_dot_general}
    plain = {p for p, f in fns.items() if f is jax.lax.dot_general}
    assert fp8 | plain == set(fns)
    for part in ("attention/wq_a", "attention/wkv_b", "attention/wo", "mlp/wi_0",
                 "shared_experts/wo"):
        assert any(part in p for p in fp8), part
    assert {p for p in plain if "router" not in p} == (set() if head else {"head"})
    assert all("router" in p or p == "head" for p in plain)


def test_transformer_min_dim_wiring():
    """fp8_min_dim reaches every FP8 projection's dot_general; without FP8 it is inert (the
    default, 4096, with quantization='': every projection plain)."""
    cfg = dataclasses.replace(SMALL, quantization="te_fp8_currentscaling", fp8_min_dim=4096)
    fns = _dot_generals(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    gated = {p for p, f in fns.items() if isinstance(f, functools.partial)
             and f.func is fp8_dot.fp8_dot_general and f.keywords == {"min_dim": 4096}}
    assert gated == {p for p in fns if "router" not in p and p != "head"}
    assert SMALL.quantization == "" and SMALL.fp8_min_dim == 4096
    fns = _dot_generals(nnx.eval_shape(lambda: Transformer(SMALL, rngs=nnx.Rngs(0))))
    assert fns and all(f is jax.lax.dot_general for f in fns.values())
    assert bf16_dense_matmuls(SMALL) == [] and bf16_dense_matmuls_line(SMALL) is None


@pytest.mark.parametrize("min_dim", [0, 4096])
def test_transformer_bf16_output_wiring(min_dim):
    """fp8_dot_bf16_output reaches every FP8 projection's dot_general, beside fp8_min_dim."""
    cfg = dataclasses.replace(SMALL, quantization="te_fp8_currentscaling", fp8_min_dim=min_dim,
                              fp8_dot_bf16_output=True)
    fns = _dot_generals(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    want = {"bf16_output": True, **({"min_dim": min_dim} if min_dim else {})}
    gated = {p for p, f in fns.items() if isinstance(f, functools.partial)
             and f.func is fp8_dot.fp8_dot_general and f.keywords == want}
    assert gated == {p for p in fns if "router" not in p and p != "head"}


def _preset(name, *overrides):
    return load_config(None, [f"model_name={name}", *overrides], environ={}).config.model()


def test_bf16_dense_matmuls_of_the_proxy():
    """deepseek3-proxy under FP8 at the default 4096: MLA's four narrow projections (q_lora_rank
    1536, kv_lora_rank 512 + rope 64, 128 heads x (128 + 64) and x (128 + 128)) and the shared
    expert (moe_mlp_dim 2048) stay bf16; wo (16384 x 7168) and the dense MLP (7168 x 18432)
    are FP8, and so is the head when quantized (7168 x 129280). One line names them all."""
    cfg = _preset("deepseek3-proxy", "quantization=te_fp8_currentscaling", "quantize_output_head=true")
    assert cfg.fp8_min_dim == 4096
    assert sorted(bf16_dense_matmuls(cfg)) == sorted([
        ("attention/wq_a", 7168, 1536), ("attention/wq_b", 1536, 24576),
        ("attention/wkv_a", 7168, 576), ("attention/wkv_b", 512, 32768),
        ("shared_experts/wi_0", 7168, 2048), ("shared_experts/wi_1", 7168, 2048),
        ("shared_experts/wo", 2048, 7168)])
    line = bf16_dense_matmuls_line(cfg)
    assert "\n" not in line and line.startswith("fp8_min_dim=4096: ")
    assert "attention/wq_b 1536x24576" in line and line.endswith("fp8_min_dim=0 quantizes them all")
    assert bf16_dense_matmuls(dataclasses.replace(cfg, fp8_min_dim=0)) == []
    # A lower threshold keeps only what is below it: wkv_a's N = 576 and wkv_b's K = 512.
    assert sorted(bf16_dense_matmuls(dataclasses.replace(cfg, fp8_min_dim=1024))) == [
        ("attention/wkv_a", 7168, 576), ("attention/wkv_b", 512, 32768)]


def test_bf16_dense_matmuls_of_tiny_and_without_fp8():
    """deepseek3-tiny (every dim <= 256) under FP8 at 4096: every FP8-capable projection of
    every layer kind (MLA, dense MLP, shared expert) once; the head only when quantized. No
    FP8: nothing (the default is inert)."""
    cfg = _preset("deepseek3-tiny", "quantization=te_fp8_currentscaling")
    rows = bf16_dense_matmuls(cfg)
    assert {name for name, _, _ in rows} == {
        f"attention/{p}" for p in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")} | {
        f"{m}/{p}" for m in ("mlp", "shared_experts") for p in ("wi_0", "wi_1", "wo")}
    assert len(rows) == len(set(rows)) == 11
    assert ("mlp/wi_0", 64, 128) in rows and ("shared_experts/wo", 64, 64) in rows
    head = bf16_dense_matmuls(dataclasses.replace(cfg, quantize_output_head=True))
    assert sorted(head) == sorted(rows + [("head", 64, 256)])
    assert bf16_dense_matmuls(_preset("deepseek3-tiny")) == []
