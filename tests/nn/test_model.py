"""The DeepSeek-V3 model: parameter count at full size (abstractly), causality,
attention backends, RoPE/YaRN, scan == unrolled, depth-independent program size.

Legend: B batch, S sequence, H heads, Q q/k head dim, V v head dim, R rope dim.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dropless.config.sections import MLAConfig, ModelConfig, MoEConfig
from dropless.nn import attention, rope
from dropless.nn.model import Transformer, count_params

SMALL = ModelConfig(
    vocab_size=32, emb_dim=16, num_decoder_layers=3, first_num_dense_layers=1, mlp_dim=32,
    mla=MLAConfig(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8),
    moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_mlp_dim=16, shared_experts=1,
                  routed_score_func="sigmoid", n_routing_groups=2, topk_routing_group=1,
                  routed_bias=True, gmm_backend="xla"),
    mtp_num_layers=1,
)

V3_MLA = MLAConfig(num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, rope_factor=40.0,
                   original_max_position_embeddings=4096, beta_fast=32, beta_slow=1)
V3 = ModelConfig(
    vocab_size=129280, emb_dim=7168, num_decoder_layers=61, first_num_dense_layers=3,
    mlp_dim=18432, dtype="bfloat16", weight_dtype="bfloat16", mla=V3_MLA,
    moe=MoEConfig(num_experts=256, num_experts_per_tok=8, moe_mlp_dim=2048, shared_experts=1,
                  routed_score_func="sigmoid", n_routing_groups=8, topk_routing_group=4,
                  routed_scaling_factor=2.5, routed_bias=True),
)


def _abstract(cfg):
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def test_deepseek_v3_671b_builds_abstractly_with_the_right_size():
    main = count_params(_abstract(V3))
    assert main == pytest.approx(671.0e9, rel=2e-3), main
    with_mtp = count_params(_abstract(dataclasses.replace(V3, mtp_num_layers=1)))
    # One MTP module: an MoE layer (~11.5B) + eh_proj; embedding and head are
    # shared here, which the released checkpoint's ~14B counts a second time.
    extra = with_mtp - main
    shared_copies = 2 * 129280 * 7168
    assert extra + shared_copies == pytest.approx(14e9, rel=0.05), extra
    assert extra == pytest.approx(11.61e9, rel=1e-2)


def _model(cfg=SMALL, seed=0):
    """A concrete model, initialised under jit (one compile instead of op-by-op)."""
    graphdef = nnx.graphdef(_abstract(cfg))
    state = jax.jit(lambda: nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed))))()
    return nnx.merge(graphdef, state)


def _jit_forward(model):
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, tokens: nnx.merge(graphdef, s)(tokens))
    return lambda tokens: fwd(state, tokens)


def test_outputs_and_causality():
    model = _jit_forward(_model())
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, SMALL.vocab_size)
    out = model(tokens)
    assert out.logits_BSV.shape == (2, 12, 32) and out.logits_BSV.dtype == jnp.float32
    assert len(out.mtp_logits) == 1 and out.mtp_logits[0].shape == (2, 12, 32)
    assert out.moe_stats[("moe_layers",)].tokens_per_expert.shape == (2, 4)
    assert out.moe_stats[("mtp", 0)].tokens_per_expert.shape == (4,)
    # Changing token 7 changes no logit before position 7 (attention and routing are causal).
    changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % SMALL.vocab_size)
    out2 = model(changed)
    np.testing.assert_array_equal(out.logits_BSV[:, :7], out2.logits_BSV[:, :7])
    assert not np.allclose(out.logits_BSV[:, 7:], out2.logits_BSV[:, 7:])


def test_logits_in_the_heads_dtype_on_request():
    """``float32_logits=False`` (the trainer's loss reads them so) gives the bf16 model's head
    output as it is: the float32 logits are exactly its cast."""
    model = _model(dataclasses.replace(SMALL, dtype="bfloat16"))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, SMALL.vocab_size)
    as_is = model(tokens, float32_logits=False)
    out = model(tokens)
    for a, b in [(as_is.logits_BSV, out.logits_BSV), (as_is.mtp_logits[0], out.mtp_logits[0])]:
        assert a.dtype == jnp.bfloat16 and b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b))


def test_scan_equals_unrolled_layers():
    scanned = _model()
    unrolled = nnx.merge(nnx.graphdef(_abstract(dataclasses.replace(SMALL, scan_layers=False))),
                         nnx.state(scanned))
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, SMALL.vocab_size)
    np.testing.assert_allclose(_jit_forward(scanned)(tokens).logits_BSV,
                               _jit_forward(unrolled)(tokens).logits_BSV, rtol=1e-5, atol=1e-5)


def test_program_size_does_not_grow_with_depth():
    def eqns(n_dense, n_moe):
        cfg = dataclasses.replace(SMALL, num_decoder_layers=n_dense + n_moe,
                                  first_num_dense_layers=n_dense, mtp_num_layers=0)
        graphdef, state = nnx.split(_abstract(cfg))
        tokens = jnp.zeros((1, 8), jnp.int32)
        return len(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens).logits_BSV)(state).eqns)

    assert eqns(1, 2) == eqns(3, 9)


def test_fused_attention_padding_matches_dot_product():
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (2, 10, 3, 12))
    k = jax.random.normal(kk, (2, 10, 3, 12))
    v = jax.random.normal(kv, (2, 10, 3, 8))  # V < Q as in V3 (128 vs 192)
    ref = attention.dot_product_attention(q, k, v, scale=0.3)
    got = attention.fused_attention(q, k, v, scale=0.3, implementation="xla")
    assert got.shape == (2, 10, 3, 8)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    # Causal: the first query sees only the first key.
    np.testing.assert_allclose(ref[:, 0], v[:, 0], rtol=1e-6)


def test_plain_q_projection_and_config_errors():
    cfg = dataclasses.replace(SMALL, mla=dataclasses.replace(SMALL.mla, q_lora_rank=0))
    model = _abstract(cfg)
    assert not hasattr(model.dense_layers.layers.attention, "wq_a")
    assert hasattr(model.dense_layers.layers.attention, "wq")
    graphdef, state = nnx.split(model)
    out = jax.eval_shape(lambda s: nnx.merge(graphdef, s)(jnp.zeros((1, 4), jnp.int32)), state)
    assert out.logits_BSV.shape == (1, 4, 32)
    with pytest.raises(ValueError, match="first_num_dense_layers=4"):
        _abstract(dataclasses.replace(SMALL, first_num_dense_layers=4))
    with pytest.raises(ValueError, match="attention='flash'"):
        _abstract(dataclasses.replace(SMALL, mla=dataclasses.replace(SMALL.mla, attention="flash")))
    with pytest.raises(ValueError, match="needs dtype bfloat16 or float16"):
        _abstract(dataclasses.replace(SMALL, mla=dataclasses.replace(SMALL.mla, attention="cudnn_flash_te")))
    with pytest.raises(ValueError, match="quantization='fp4' is not one of"):
        _abstract(dataclasses.replace(SMALL, quantization="fp4"))
    with pytest.raises(ValueError, match="quantize_output_head=True needs"):
        _abstract(dataclasses.replace(SMALL, quantize_output_head=True))
    with pytest.raises(ValueError, match="qk_rope_head_dim=3"):
        rope.inv_frequencies(dataclasses.replace(SMALL.mla, qk_rope_head_dim=3))


def test_yarn_numbers():
    # V3: mscale = 0.1 * ln(40) + 1; logit scale = 192**-0.5 * mscale**2.
    m = 0.1 * math.log(40) + 1
    assert rope.yarn_mscale(40, 1.0) == pytest.approx(m)
    assert rope.yarn_softmax_scale(V3_MLA) == pytest.approx(192**-0.5 * m * m)
    plain = rope.inv_frequencies(dataclasses.replace(V3_MLA, rope_factor=1.0))
    yarn = rope.inv_frequencies(V3_MLA)
    np.testing.assert_allclose(plain, 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-6)
    # Fast-rotating pairs keep their frequency; slow ones are divided by the factor.
    np.testing.assert_allclose(yarn[:5], plain[:5], rtol=1e-6)
    np.testing.assert_allclose(yarn[-5:], plain[-5:] / 40, rtol=1e-6)
    assert np.all(np.diff(np.asarray(yarn)) < 0)


def test_rope_depends_on_relative_position_only():
    cfg = dataclasses.replace(V3_MLA, qk_rope_head_dim=8)
    q = jax.random.normal(jax.random.key(4), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(5), (1, 1, 1, 8))

    def score(pq, pk):
        cq, sq = rope.rope_cos_sin(jnp.array([[pq]]), cfg)
        ck, sk = rope.rope_cos_sin(jnp.array([[pk]]), cfg)
        return float(jnp.sum(rope.apply_rope(q, cq, sq) * rope.apply_rope(k, ck, sk)))

    assert score(7, 3) == pytest.approx(score(107, 103), rel=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-3)
    cos, sin = rope.rope_cos_sin(jnp.array([[0]]), cfg)
    np.testing.assert_allclose(rope.apply_rope(q, cos, sin), q)  # position 0: identity
