"""Write the tiny random Mixtral fixture of the Hugging Face parity tests.

Run with a Python that has torch, transformers >= 5 and safetensors (not
dropless's own environment)::

    python3 tools/make_hf_fixture_mixtral.py tests/hf/fixtures/mixtral

The model is built by transformers' ``MixtralForCausalLM`` in float32 with
what Mixtral-8x7B has, at toy size: every layer MoE, GQA with fewer kv heads
(4 query / 2 kv) and no q/k norm, no ``head_dim`` key (hidden_size // heads,
as the published config.json), softmax top-2 of 8 experts renormalised over
the top 2, no shared expert, no routing bias, untied embeddings,
``sliding_window: null``; RMSNorm weights away from 1. Every weight is rounded
to a bfloat16 value, so the bf16 files hold the float32 model exactly.

Written under OUT:

    fused/          transformers 5 layout: its own state_dict names
                    (``mlp.gate.weight``, fused ``mlp.experts.gate_up_proj`` /
                    ``down_proj``) and its config.json (``rope_parameters``);
                    one file.
    published/      the layout Mixtral-8x7B-v0.1 ships:
                    ``block_sparse_moe.gate.weight`` and per-expert
                    ``block_sparse_moe.experts.N.{w1,w2,w3}.weight`` (w1 gate,
                    w3 up, w2 down), config.json with ``rope_theta``; all bf16,
                    router included; sharded in two files + index.
    tokens.npy      int32 [B, S] input tokens
    logits.npy      float32 [B, S, V] transformers' logits (eager attention)
    experts.npy     int32 [L, B*S, K] routed experts per layer, sorted per token
    meta.json       versions, the config, the smallest routing margin (k-th
                    minus (k+1)-th router probability over all tokens), and
                    the names transformers' own save_pretrained wrote

Before writing, transformers loads published/ back (its conversion of the
per-expert names) and must give the same logits bit for bit.
"""

import os
import sys
import tempfile

import numpy as np
import torch
from hf_fixture_common import (meta, out_dir, published_tensors, random_model, random_tokens, routing_margin,
                               run, write_fused, write_meta, write_outputs, write_published)
from safetensors import safe_open
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

SEED = 0
BATCH, SEQ = 2, 24
ROUTER = "MixtralTopKRouter"

HF_CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=32,  # the experts' width
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    hidden_act="silu",
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    sliding_window=None,
    router_aux_loss_coef=0.02,
    router_jitter_noise=0.0,
    initializer_range=0.3,
)
ROPE_THETA = 1_000_000.0


def published_config() -> dict:
    """config.json as Mixtral-8x7B-v0.1's is written (transformers 4.36 keys)."""
    c = {k: v for k, v in HF_CONFIG.items() if k not in ("initializer_range", "router_jitter_noise")}
    c.update(architectures=["MixtralForCausalLM"], model_type="mixtral", rope_theta=ROPE_THETA,
             output_router_logits=False, attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
             torch_dtype="bfloat16")
    return c


def build_model() -> MixtralForCausalLM:
    rope = {"rope_type": "default", "rope_theta": ROPE_THETA}
    return random_model(MixtralConfig, MixtralForCausalLM, HF_CONFIG, rope, SEED)


def mixtral_tensors(state: dict) -> dict:
    """transformers 5's state_dict -> Mixtral's published names (per-expert w1/w3/w2)."""
    return published_tensors({k.replace(".mlp.", ".block_sparse_moe."): v for k, v in state.items()},
                             gate="w1", up="w3", down="w2")


def saved_names(model) -> list[str]:
    """The tensor names transformers' own save_pretrained writes (for meta.json)."""
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        names = []
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(d, f), "pt") as fh:
                    names += list(fh.keys())
    return sorted(n for n in names if n.startswith("model.layers.0."))


def check_published_loads(path: str, tokens, logits) -> None:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        again = model.eval()(torch.from_numpy(tokens).long()).logits.float().numpy()
    if not np.array_equal(again, logits):
        raise SystemExit(f"transformers reads {path} differently: max |diff| {np.abs(again - logits).max()}")


def main(argv=None) -> int:
    out = out_dir(argv, __doc__.splitlines()[0])
    model = build_model()
    tokens = random_tokens(SEED, HF_CONFIG["vocab_size"], BATCH, SEQ)
    logits, experts = run(model, tokens, router=ROUTER)
    state = {k: v.detach().bfloat16().contiguous() for k, v in model.state_dict().items()}

    write_fused(out, model, state)
    write_published(os.path.join(out, "published"), mixtral_tensors(state), published_config(), 2)
    check_published_loads(os.path.join(out, "published"), tokens, logits)

    write_outputs(out, tokens, logits, experts)
    record = meta("tools/make_hf_fixture_mixtral.py", SEED, BATCH, SEQ, HF_CONFIG, {"rope_theta": ROPE_THETA},
                  min_routing_margin=routing_margin(model, tokens, ROUTER),
                  save_pretrained_layer0_names=saved_names(model))
    size = write_meta(out, record)
    print(f"wrote {out}: {size / 1e6:.3f} MB; logits {logits.shape}, experts {experts.shape}, "
          f"min routing margin {record['min_routing_margin']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
