"""Write the tiny random Qwen3-MoE fixture of the Hugging Face parity tests.

Run with a Python that has torch, transformers >= 5 and safetensors (not
dropless's own environment)::

    python3 tools/make_hf_fixture_qwen3.py tests/hf/fixtures/qwen3_moe

The model is built by transformers' ``Qwen3MoeForCausalLM`` in float32 with
what Qwen3-30B-A3B has, at toy size: GQA with fewer kv heads (4 query / 2 kv)
and a head dim that is not hidden_size // heads (as the 30B's 128 != 2048 /
32), RMSNorm on q and k, softmax top-2 routing renormalised over the top 2
(``norm_topk_prob``) with no shared expert and no routing bias, untied
embeddings; plus one dense ``mlp_only_layers`` layer first, and RMSNorm
weights away from 1. Every weight is rounded to a bfloat16 value, so the bf16
files hold the float32 model exactly.

Written under OUT:

    fused/          transformers 5 layout: its own state_dict names (fused
                    ``mlp.experts.gate_up_proj`` / ``down_proj``) and its
                    config.json (``rope_parameters``); one file.
    published/      the layout Qwen3-30B-A3B ships: per-expert
                    ``mlp.experts.N.{gate,up,down}_proj.weight``, config.json
                    with ``rope_theta`` + ``rope_scaling: null``; all bf16,
                    router included; sharded in two files + index.
    tokens.npy      int32 [B, S] input tokens
    logits.npy      float32 [B, S, V] transformers' logits (eager attention)
    experts.npy     int32 [L_moe, B*S, K] routed experts per MoE layer, sorted per token
    meta.json       versions, the config, and the smallest routing margin
                    (k-th minus (k+1)-th router probability over all tokens)
"""

import os
import sys

from hf_fixture_common import (meta, out_dir, published_tensors, random_model, random_tokens, routing_margin,
                               run, write_fused, write_meta, write_outputs, write_published)
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

SEED = 0
BATCH, SEQ = 2, 24
ROUTER = "Qwen3MoeTopKRouter"

HF_CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,  # the dense (mlp_only) layer
    moe_intermediate_size=16,
    num_hidden_layers=3,
    mlp_only_layers=[0],
    decoder_sparse_step=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
    router_aux_loss_coef=0.001,
    initializer_range=0.3,
)
ROPE_THETA = 1_000_000.0


def published_config() -> dict:
    """config.json as Qwen3-30B-A3B's is written (transformers 4.51 keys)."""
    c = {k: v for k, v in HF_CONFIG.items() if k != "initializer_range"}
    c.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", rope_theta=ROPE_THETA,
             rope_scaling=None, sliding_window=None, output_router_logits=False, attention_dropout=0.0,
             torch_dtype="bfloat16")
    return c


def build_model() -> Qwen3MoeForCausalLM:
    rope = {"rope_type": "default", "rope_theta": ROPE_THETA}
    return random_model(Qwen3MoeConfig, Qwen3MoeForCausalLM, HF_CONFIG, rope, SEED)


def main(argv=None) -> int:
    out = out_dir(argv, __doc__.splitlines()[0])
    model = build_model()
    tokens = random_tokens(SEED, HF_CONFIG["vocab_size"], BATCH, SEQ)
    logits, experts = run(model, tokens, router=ROUTER)
    state = {k: v.detach().bfloat16().contiguous() for k, v in model.state_dict().items()}

    write_fused(out, model, state)
    write_published(os.path.join(out, "published"), published_tensors(state), published_config(), 2)

    write_outputs(out, tokens, logits, experts)
    record = meta("tools/make_hf_fixture_qwen3.py", SEED, BATCH, SEQ, HF_CONFIG, {"rope_theta": ROPE_THETA},
                  min_routing_margin=routing_margin(model, tokens, ROUTER))
    size = write_meta(out, record)
    print(f"wrote {out}: {size / 1e6:.3f} MB; logits {logits.shape}, experts {experts.shape}, "
          f"min routing margin {record['min_routing_margin']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
