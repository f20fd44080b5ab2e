"""Write the tiny random DeepSeek-V3 fixture of the Hugging Face parity tests.

Run with a Python that has torch, transformers >= 5 and safetensors (not
dropless's own environment; the GPU machine's ``python3`` has them)::

    python3 tools/make_hf_fixture.py tests/hf/fixtures

The model is built by transformers' ``DeepseekV3ForCausalLM`` in float32 with
everything the parity must cover: a low-rank query (q_lora), YaRN RoPE whose
two mscales differ (so both the cos/sin amplitude and the softmax scale are
exercised) at a sequence longer than the pre-extension context, group-limited
sigmoid routing with a nonzero balancing bias, a shared expert, one dense
layer, and RMSNorm weights away from 1. Every weight is rounded to a bfloat16
value, so the bf16 files hold the float32 model exactly.

Written under OUT:

    fused/          transformers 5 layout: its own state_dict names (fused
                    ``mlp.experts.gate_up_proj`` / ``down_proj``), config.json
                    with ``rope_parameters``; one file.
    published/      the published DeepSeek-V3 layout: per-expert
                    ``mlp.experts.N.{gate,up,down}_proj.weight``, config.json
                    with ``rope_scaling`` + ``rope_theta``; sharded + index.
    fp8_mtp/        published layout with the decoder's projections in FP8
                    E4M3 with 128x128 ``weight_scale_inv`` blocks (the dense
                    MLP is 160 wide, so some weights span two blocks), plus one
                    MTP layer (``model.layers.3.*``, as DeepSeek-V3 ships it).
    tokens.npy      int32 [B, S] input tokens
    logits.npy      float32 [B, S, V] transformers' logits of fused/ and published/
    experts.npy     int32 [L_moe, B*S, K] routed experts per MoE layer, sorted per token
    logits_fp8.npy, experts_fp8.npy   the same for fp8_mtp/ (its dequantized weights)
    meta.json       versions and the config used
"""

import os
import sys

import numpy as np
import torch
from hf_fixture_common import (meta, out_dir, published_tensors, random_model, random_tokens, run, write_fused,
                               write_meta, write_outputs, write_published)
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

SEED = 0
BATCH, SEQ = 2, 24
BLOCK = 128  # DeepSeek-V3's FP8 weight block (quantization_config.weight_block_size)
ROUTER = "DeepseekV3TopkRouter"

HF_CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=160,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=8,
    qk_nope_head_dim=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_interleave=True,
    attention_bias=False,
    initializer_range=0.3,
    num_mtp_layers=0,  # the transformers model has no MTP weights; fp8_mtp/ adds one layer
)
ROPE = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)
ROPE_THETA = 10000.0


def published_config(num_mtp: int, fp8: bool) -> dict:
    """config.json as the published DeepSeek-V3 checkpoint writes it."""
    c = {k: v for k, v in HF_CONFIG.items() if k not in ("initializer_range", "num_mtp_layers")}
    c.update(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        rope_theta=ROPE_THETA, rope_scaling={"type": "yarn", **{k: v for k, v in ROPE.items() if k != "rope_type"}},
        num_nextn_predict_layers=num_mtp, n_group=HF_CONFIG["n_group"], topk_method="noaux_tc",
        scoring_func="sigmoid", moe_layer_freq=1, torch_dtype="bfloat16",
    )
    if fp8:
        c["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                    "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    return c


def build_model() -> DeepseekV3ForCausalLM:
    model = random_model(DeepseekV3Config, DeepseekV3ForCausalLM, HF_CONFIG, {"rope_theta": ROPE_THETA, **ROPE}, SEED)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
            if "bias" in name:
                b.copy_(b.bfloat16().float())  # bf16 files then hold the model exactly
    return model


def to_file_dtype(name: str, t: torch.Tensor) -> torch.Tensor:
    # As DeepSeek-V3 ships: the router and its bias in float32, the rest bf16.
    if name.endswith("e_score_correction_bias") or name.endswith("mlp.gate.weight"):
        return t.float().contiguous()
    return t.bfloat16().contiguous()


def is_fp8_weight(name: str) -> bool:
    """Weights DeepSeek-V3 stores in FP8: the decoder's projections (not the router, norms, eh_proj)."""
    return name.startswith("model.layers.") and name.endswith("proj.weight") and ".eh_proj." not in name \
        and ".shared_head." not in name


def quantize_block(w: torch.Tensor):
    """(E4M3 codes, float32 scale_inv [ceil(out/128), ceil(in/128)]), dequant = codes * scale_inv."""
    rows, cols = w.shape
    sr, sc = -(-rows // BLOCK), -(-cols // BLOCK)
    scale = torch.empty(sr, sc, dtype=torch.float32)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            codes[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / s).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize(codes, scale):
    rows, cols = codes.shape
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return codes.float() * full


def mtp_tensors(model, layer: int, gen: torch.Generator) -> dict:
    """Random weights of one MTP layer under ``model.layers.{layer}``, published names."""
    d = HF_CONFIG["hidden_size"]
    std = HF_CONFIG["initializer_range"]
    out = {}
    # The decoder layer part: same shapes as the last (MoE) layer.
    last = HF_CONFIG["num_hidden_layers"] - 1
    src = published_tensors({k: v for k, v in model.state_dict().items() if k.startswith(f"model.layers.{last}.")})
    for name, t in src.items():
        new = name.replace(f"model.layers.{last}.", f"model.layers.{layer}.")
        if "norm" in name:
            out[new] = 1.0 + 0.2 * torch.randn(t.shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            out[new] = 0.05 * torch.randn(t.shape, generator=gen)
        else:
            out[new] = std * torch.randn(t.shape, generator=gen)
    p = f"model.layers.{layer}."
    out[p + "enorm.weight"] = 1.0 + 0.2 * torch.randn(d, generator=gen)
    out[p + "hnorm.weight"] = 1.0 + 0.2 * torch.randn(d, generator=gen)
    out[p + "eh_proj.weight"] = std * torch.randn(d, 2 * d, generator=gen)
    out[p + "shared_head.norm.weight"] = 1.0 + 0.2 * torch.randn(d, generator=gen)
    # DeepSeek-V3 ships copies of the embedding and the head in its MTP layer.
    out[p + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    out[p + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return {k: v.bfloat16().float() for k, v in out.items()}


def main(argv=None) -> int:
    out = out_dir(argv, __doc__.splitlines()[0])
    model = build_model()
    tokens = random_tokens(SEED, HF_CONFIG["vocab_size"], BATCH, SEQ)
    logits, experts = run(model, tokens, ROUTER)
    state = {k: v.detach() for k, v in model.state_dict().items()}

    # transformers 5 layout: its own names and config.json.
    write_fused(out, model, {k: to_file_dtype(k, v) for k, v in state.items()})

    # Published layout, sharded.
    pub = published_tensors(state)
    write_published(os.path.join(out, "published"), {k: to_file_dtype(k, v) for k, v in pub.items()},
                    published_config(0, fp8=False), 3)

    # FP8 + MTP: quantize the projections; the reference model runs their dequantized values.
    gen = torch.Generator().manual_seed(SEED + 1)
    fp8 = {**pub, **mtp_tensors(model, HF_CONFIG["num_hidden_layers"], gen)}
    files, deq = {}, {}
    for name, t in fp8.items():
        if is_fp8_weight(name):
            codes, scale = quantize_block(t.float())
            files[name], files[name + "_scale_inv"] = codes, scale
            deq[name] = dequantize(codes, scale)
        else:
            files[name] = to_file_dtype(name, t)
            deq[name] = t
    write_published(os.path.join(out, "fp8_mtp"), files, published_config(1, fp8=True), 2)
    ref = build_model()
    ref_state = ref.state_dict()
    with torch.no_grad():
        f = HF_CONFIG["moe_intermediate_size"]
        for name, t in ref_state.items():
            if name.endswith("mlp.experts.gate_up_proj"):
                base = name[: -len("gate_up_proj")]
                t.copy_(torch.stack([torch.cat([deq[f"{base}{e}.gate_proj.weight"],
                                                deq[f"{base}{e}.up_proj.weight"]]) for e in range(t.shape[0])]))
            elif name.endswith("mlp.experts.down_proj"):
                base = name[: -len("down_proj")]
                t.copy_(torch.stack([deq[f"{base}{e}.down_proj.weight"] for e in range(t.shape[0])]))
            else:
                t.copy_(deq[name])
    logits_fp8, experts_fp8 = run(ref, tokens, ROUTER)

    write_outputs(out, tokens, logits, experts)
    np.save(os.path.join(out, "logits_fp8.npy"), logits_fp8.astype(np.float32))
    np.save(os.path.join(out, "experts_fp8.npy"), experts_fp8)
    record = meta("tools/make_hf_fixture.py", SEED, BATCH, SEQ, HF_CONFIG,
                  {"rope_parameters": {"rope_theta": ROPE_THETA, **ROPE}})
    size = write_meta(out, record)
    print(f"wrote {out}: {size / 1e6:.3f} MB; logits {logits.shape}, experts {experts.shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
