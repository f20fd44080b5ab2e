"""Grouped-query attention: the module against a float64 numpy transcription of
transformers' Qwen3 attention, the grouped attention backends against plain
multi-head attention over repeated kv heads, rotate-half RoPE, config errors,
and the structure of a Qwen3-MoE-shaped model.

Legend: B batch, S sequence, D model dim, H query heads, K kv heads, G = H // K,
Dh head dim.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dropless.config.sections import GQAConfig, ModelConfig, MoEConfig
from dropless.nn import attention, rope
from dropless.nn.gqa import GQA
from dropless.nn.model import Transformer

B, S, D, DH = 2, 7, 32, 8


def _reference(x, p, cfg: GQAConfig, positions):
    """transformers' Qwen3MoeAttention in float64 numpy, one head at a time.

    p: wq [D, H*Dh], wk, wv [D, K*Dh], wo [H*Dh, D], q_norm, k_norm [Dh] (or None).
    """
    h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = cfg.normalization_layer_epsilon
    b, s, _ = x.shape
    q = (x @ p["wq"]).reshape(b, s, h, hd)
    k = (x @ p["wk"]).reshape(b, s, kv, hd)
    v = (x @ p["wv"]).reshape(b, s, kv, hd)
    if cfg.use_qk_norm:
        q = q / np.sqrt((q * q).mean(-1, keepdims=True) + eps) * p["q_norm"]
        k = k / np.sqrt((k * k).mean(-1, keepdims=True) + eps) * p["k_norm"]
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
    angles = positions[..., None] * np.concatenate([inv_freq, inv_freq])  # [B, S, Dh]
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]

    def rotate_half(t):
        return np.concatenate([-t[..., hd // 2:], t[..., : hd // 2]], -1)

    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    out = np.zeros((b, s, h, hd))
    for bi in range(b):
        for hi in range(h):
            ki = hi // (h // kv)  # repeat_kv: kv head i serves q heads i*G .. i*G+G-1
            scores = q[bi, :, hi] @ k[bi, :, ki].T / np.sqrt(hd)
            scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[bi, :, hi] = probs @ v[bi, :, ki]
    return out.reshape(b, s, h * hd) @ p["wo"]


def _params(module):
    p = {n: np.asarray(getattr(module, n).kernel[...], np.float64) for n in ("wq", "wk", "wv", "wo")}
    for n in ("q_norm", "k_norm"):
        p[n] = None if getattr(module, n) is None else np.asarray(getattr(module, n).scale[...], np.float64)
    return p


@pytest.mark.parametrize("heads,kv_heads,qk_norm", [(4, 2, True), (4, 1, True), (4, 4, False)],
                         ids=["gqa-qknorm", "mqa-qknorm", "mha"])
def test_gqa_matches_the_transformers_formula(heads, kv_heads, qk_norm):
    """float32 module vs float64 reference.

    Tolerance: each output passes through four float32 stages (projection over
    D = 32 terms, norm, a softmax-weighted sum over <= 7 keys, output
    projection over H*Dh = 32 terms), each with relative rounding error below
    n * 2**-24 ~ 2e-6 on values of order 1; 2e-5 absolute leaves a margin of
    ~2x over that worst case while a wrong kv-head mapping, RoPE layout or norm
    changes outputs by O(0.1).
    """
    cfg = GQAConfig(num_heads=heads, num_kv_heads=kv_heads, head_dim=DH, use_qk_norm=qk_norm,
                    rope_theta=1e4)
    module = GQA(cfg, emb_dim=D, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    if qk_norm:  # non-trivial norm scales, so a norm applied to the wrong axis shows
        module.q_norm.scale[...] = jax.random.uniform(jax.random.key(1), (DH,), minval=0.5, maxval=1.5)
        module.k_norm.scale[...] = jax.random.uniform(jax.random.key(2), (DH,), minval=0.5, maxval=1.5)
    x = jax.random.normal(jax.random.key(3), (B, S, D))
    # Positions with an offset per sequence (packed or continued sequences).
    positions = jnp.arange(S)[None, :] + jnp.array([[0], [11]])
    got = jax.jit(lambda m, x, p: m(x, p))(module, x, positions)
    want = _reference(np.asarray(x, np.float64), _params(module), cfg, np.asarray(positions, np.float64))
    assert got.shape == (B, S, D) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_grouped_backends_equal_attention_over_repeated_kv_heads():
    """Values and gradients of the grouped paths = MHA on k, v repeated G times.

    Both sides compute the same float32 sums in possibly different orders:
    1e-5 covers reassociation over <= 10 keys; gradients of k and v sum G
    head contributions (autodiff of the repeat on the reference side).
    """
    kq, kk, kv = jax.random.split(jax.random.key(4), 3)
    h, k_heads = 6, 2
    q = jax.random.normal(kq, (2, 10, h, 16))
    k = jax.random.normal(kk, (2, 10, k_heads, 16))
    v = jax.random.normal(kv, (2, 10, k_heads, 16))

    def mha(q, k, v):
        rep = lambda t: jnp.repeat(t, h // k_heads, axis=2)
        return attention.dot_product_attention(q, rep(k), rep(v), scale=0.25)

    grouped = lambda q, k, v: attention.dot_product_attention(q, k, v, scale=0.25)
    fused = lambda q, k, v: attention.fused_attention(q, k, v, scale=0.25, implementation="xla")
    dy = jax.random.normal(jax.random.key(5), q.shape)
    value_and_grads = jax.jit(lambda fn, q, k, v: (fn(q, k, v), jax.vjp(fn, q, k, v)[1](dy)),
                              static_argnums=0)
    want, want_grads = value_and_grads(mha, q, k, v)
    for fn in (grouped, fused):
        out, grads = value_and_grads(fn, q, k, v)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        for g, w in zip(grads, want_grads):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="4 kv heads must divide 6 query heads"):
        attention.dot_product_attention(q, jnp.zeros((2, 10, 4, 16)), jnp.zeros((2, 10, 4, 16)), scale=1.0)


def test_rotate_half_rope_is_the_interleaved_rotation_on_permuted_features():
    """The two layouts rotate the same pairs by the same angles; exact up to float32 rounding."""
    hd = 8
    x = jax.random.normal(jax.random.key(6), (1, 5, 2, hd))
    positions = jnp.arange(5)[None] * 7
    cos, sin = rope.half_cos_sin(positions, hd, 1e4)
    half = rope.apply_rope_half(x, cos, sin)
    # Interleave (j, j + hd/2) into (2j, 2j+1), rotate, and undo the interleaving.
    perm = np.stack([np.arange(hd // 2), np.arange(hd // 2) + hd // 2], -1).reshape(-1)
    inter = rope.apply_rope(x[..., perm], cos, sin)
    np.testing.assert_allclose(half, inter[..., np.argsort(perm)], rtol=1e-6, atol=1e-6)
    # Relative positions only: shifting q and k together leaves q.k unchanged.
    dot = lambda shift: jnp.sum(rope.apply_rope_half(x[:, :1], *rope.half_cos_sin(positions[:, :1] + shift, hd, 1e4))
                                * rope.apply_rope_half(x[:, 1:2], *rope.half_cos_sin(positions[:, 1:2] + shift, hd, 1e4)))
    np.testing.assert_allclose(dot(0), dot(1000), rtol=1e-4)
    with pytest.raises(ValueError, match="head_dim=7"):
        rope.half_cos_sin(positions, 7, 1e4)


def test_config_errors():
    build = lambda **kw: GQA(dataclasses.replace(GQAConfig(), **kw), emb_dim=16, dtype=jnp.float32,
                             param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        build(num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim=7 must be"):
        build(head_dim=7)
    with pytest.raises(ValueError, match="needs dtype bfloat16 or float16"):
        build(attention="cudnn_flash_te")
    with pytest.raises(ValueError, match="attention='flash'"):
        build(attention="flash")


QWEN_SMALL = ModelConfig(
    vocab_size=32, emb_dim=16, num_decoder_layers=2, first_num_dense_layers=0, mlp_dim=32,
    attention_type="gqa",
    gqa=GQAConfig(num_heads=4, num_kv_heads=2, head_dim=8, use_qk_norm=True),
    moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_mlp_dim=16, routed_score_func="softmax",
                  norm_topk_prob=True, gmm_backend="xla"),
)


def test_qwen3_moe_shaped_model_has_qwen_parameters():
    """The decoder built from attention_type=gqa: GQA in every layer, no shared expert.

    (Its training is tested in tests/train/test_qwen3_tiny.py.)
    """
    model = nnx.eval_shape(lambda: Transformer(QWEN_SMALL, rngs=nnx.Rngs(0)))
    attn = model.moe_layers.layers.attention
    assert isinstance(attn, GQA) and model.dense_layers is None
    assert attn.wq.kernel.shape == (2, 16, 4 * 8) and attn.wk.kernel.shape == (2, 16, 2 * 8)
    assert attn.q_norm.scale.shape == attn.k_norm.scale.shape == (2, 8)
    assert model.moe_layers.layers.moe.shared_experts is None
    graphdef, state = nnx.split(model)
    out = jax.eval_shape(lambda s: nnx.merge(graphdef, s)(jnp.zeros((1, 4), jnp.int32)), state)
    assert out.logits_BSV.shape == (1, 4, 32)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (cuDNN)")
def test_cudnn_gqa_matches_the_grouped_dot_product_on_gpu():
    """cuDNN flash attention with 4 kv heads for 32 query heads (Qwen3-30B's
    shape, head dim 128), bf16, values and gradients against the XLA grouped
    path. Only a GPU has cuDNN; the CPU tests cover the grouping through
    ``implementation="xla"``.

    Tolerance: both compute bf16 products with float32 accumulation and round
    the result to bf16 (relative 2**-8 = 0.4%); the softmax and blocking
    orders differ, so results may differ by a few bf16 ulps of the largest
    value: 2% of max(1, max |reference|) (outputs are of order 1; the k and v
    gradients sum 8 query heads x 512 positions and are larger). A wrong
    kv-head mapping differs by O(1) of that scale.
    """
    kq, kk, kv, kg = jax.random.split(jax.random.key(8), 4)
    q = jax.random.normal(kq, (2, 512, 32, 128), jnp.bfloat16)
    k = jax.random.normal(kk, (2, 512, 4, 128), jnp.bfloat16)
    v = jax.random.normal(kv, (2, 512, 4, 128), jnp.bfloat16)
    dy = jax.random.normal(kg, q.shape, jnp.bfloat16)
    scale = 128**-0.5

    def run(fn):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, scale=scale), q, k, v)
        return out, vjp(dy)

    want, want_grads = jax.jit(lambda: run(attention.dot_product_attention))()
    got, got_grads = jax.jit(lambda: run(attention.fused_attention))()
    f32 = lambda a: np.asarray(a, np.float32)
    for g, w in zip((got, *got_grads), (want, *want_grads)):
        g, w = f32(g), f32(w)
        np.testing.assert_allclose(g, w, atol=2e-2 * max(1.0, float(np.abs(w).max())))
