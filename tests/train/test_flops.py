"""The analytic FLOP count against a count by hand, and the peak table."""

import dataclasses

import pytest

from dropless.config.sections import MLAConfig, ModelConfig, MoEConfig
from dropless.train import flops

# Sizes chosen so every term is a distinct small number.
CFG = ModelConfig(
    vocab_size=100, emb_dim=8, num_decoder_layers=3, first_num_dense_layers=1, mlp_dim=20,
    mla=MLAConfig(num_heads=2, q_lora_rank=4, kv_lora_rank=6, qk_nope_head_dim=3,
                  qk_rope_head_dim=2, v_head_dim=5),
    moe=MoEConfig(num_experts=4, num_experts_per_tok=2, shared_experts=1, moe_mlp_dim=7),
)
BATCH, SEQ = 2, 10
TOKENS = BATCH * SEQ

# Multiply-accumulates per token of one forward pass, by hand:
DENSE_MLP = 3 * 8 * 20                 # gate, up, down: D x mlp each
MOE_FFN = 8 * 4 + 3 * (3 * 8 * 7)      # router D x E; (top-2 + 1 shared) SwiGLU experts
MLA_PROJ = (8 * 4                      # wq_a: D x q_lora
            + 4 * 2 * (3 + 2)          # wq_b: q_lora x H*(nope+rope)
            + 8 * (6 + 2)              # wkv_a: D x (kv_lora+rope)
            + 6 * 2 * (3 + 5)          # wkv_b: kv_lora x H*(nope+v)
            + 2 * 5 * 8)               # wo: H*v x D
ATTENTION = SEQ * 2 * ((3 + 2) + 5) / 2  # q.k and p.v over S keys, H heads; causal half
HEAD = 8 * 100                         # D x V


def _tflops(macs_per_token, accum=1):
    return 2 * macs_per_token * TOKENS * 3 * accum / 1e12  # 2 FLOPs/MAC, fwd + bwd = 3x


def test_matches_hand_count():
    got = flops.training_tflops_per_device(CFG, BATCH, SEQ)
    weights = DENSE_MLP + 2 * MOE_FFN + 3 * MLA_PROJ + HEAD
    assert got.learnable_weight == pytest.approx(_tflops(weights), rel=1e-12)
    assert got.attention == pytest.approx(_tflops(3 * ATTENTION), rel=1e-12)
    assert got.total == pytest.approx(_tflops(weights + 3 * ATTENTION), rel=1e-12)


def test_accumulation_plain_q_and_mtp():
    got = flops.training_tflops_per_device(CFG, BATCH, SEQ, gradient_accumulation_steps=4)
    assert got.total == pytest.approx(4 * flops.training_tflops_per_device(CFG, BATCH, SEQ).total)

    plain_q = dataclasses.replace(CFG, mla=dataclasses.replace(CFG.mla, q_lora_rank=0))
    delta = (8 * 4 + 4 * 2 * 5) - 8 * 2 * 5  # low-rank q pair vs one D x H*(nope+rope)
    base = flops.training_tflops_per_device(CFG, BATCH, SEQ).total
    assert flops.training_tflops_per_device(plain_q, BATCH, SEQ).total == pytest.approx(
        base - _tflops(3 * delta))

    mtp = dataclasses.replace(CFG, mtp_num_layers=1)
    extra = MOE_FFN + MLA_PROJ + ATTENTION + 2 * 8 * 8 + HEAD  # layer, eh_proj 2D x D, head
    assert flops.training_tflops_per_device(mtp, BATCH, SEQ).total == pytest.approx(base + _tflops(extra))


def test_deepseek_v3_order_of_magnitude():
    # V3: ~37B active parameters -> ~6 * 37e9 FLOPs per token plus attention.
    v3 = ModelConfig(
        vocab_size=129280, emb_dim=7168, num_decoder_layers=61, first_num_dense_layers=3,
        mlp_dim=18432,
        mla=MLAConfig(num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(num_experts=256, num_experts_per_tok=8, shared_experts=1, moe_mlp_dim=2048),
    )
    got = flops.training_tflops_per_device(v3, 1, 4096)
    per_token_weights = got.learnable_weight * 1e12 / 4096 / 6
    assert 36e9 < per_token_weights < 39e9


def test_peak_table():
    assert flops.peak_tflops("NVIDIA H200") == pytest.approx(989.4)
    assert flops.peak_tflops("NVIDIA H200", "fp8") == pytest.approx(1978.9)
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4)
    assert flops.peak_tflops("NVIDIA H100 PCIe") == pytest.approx(756.0)
    assert flops.peak_tflops("cpu") is None
    assert flops.peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert flops.precision_of(CFG) == "bf16"
    assert flops.precision_of(dataclasses.replace(CFG, quantization="te_fp8_currentscaling")) == "fp8"


def test_gqa_weight_flops_are_six_per_active_parameter():
    """Weight FLOPs of a Qwen3-MoE-style model = 6 x tokens x the matmul parameters a
    token meets, counted from the built model (attention, router, head, and the
    experts' parameters times top-k / E); attention = q.k and p.v over all H
    query heads, causal half."""
    import jax
    from flax import nnx

    from dropless.config.sections import GQAConfig
    from dropless.nn.model import Transformer
    from dropless.parallel.sharding import path_names

    cfg = ModelConfig(
        vocab_size=100, emb_dim=8, num_decoder_layers=2, first_num_dense_layers=0, mlp_dim=20,
        attention_type="gqa", gqa=GQAConfig(num_heads=6, num_kv_heads=2, head_dim=4),
        moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_mlp_dim=7),
    )
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    sizes = {"/".join(n for n in path_names(path) if n != "value"): x.size
             for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}
    attn = sum(v for k, v in sizes.items() if "attention" in k and "kernel" in k)
    experts = sum(v for k, v in sizes.items() if k.endswith(("wi", "wo")) and "moe" in k)
    router = sum(v for k, v in sizes.items() if "router" in k)
    head = sizes["head/kernel"]
    assert attn == 2 * 8 * 4 * (6 + 2 + 2 + 6)  # q, k, v, o over two layers
    active = attn + router + head + experts * 2 / 4
    got = flops.training_tflops_per_device(cfg, BATCH, SEQ)
    assert got.learnable_weight == pytest.approx(6 * TOKENS * active / 1e12, rel=1e-12)
    assert got.attention == pytest.approx(_tflops(2 * SEQ * 6 * (4 + 4) / 2), rel=1e-12)
