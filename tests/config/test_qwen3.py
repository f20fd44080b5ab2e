"""Qwen3-MoE presets carry the published shapes; decoder_block and GQA keys refuse
what the model cannot be, each with one line naming the key."""

import pytest
from flax import nnx

from dropless.config.loader import ConfigError, load_config
from dropless.nn.model import Transformer, count_params


def resolve(*overrides):
    return load_config(None, list(overrides), environ={}).config


# (preset, D, layers, q heads, kv heads, expert hidden, published parameter count)
PUBLISHED = [
    ("qwen3-30b-a3b", 2048, 48, 32, 4, 768, 30.5e9),
    ("qwen3-235b-a22b", 4096, 94, 64, 4, 1536, 235.1e9),
]


@pytest.mark.parametrize("name,d,layers,heads,kv,f,params", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_presets_have_the_published_shapes(name, d, layers, heads, kv, f, params):
    cfg = resolve(f"model_name={name}")
    model = cfg.model()
    assert (cfg.emb_dim, cfg.num_decoder_layers, cfg.first_num_dense_layers) == (d, layers, 0)
    assert model.attention_type == "gqa" and cfg.decoder_block == "qwen3_moe"
    assert (model.gqa.num_heads, model.gqa.num_kv_heads, model.gqa.head_dim) == (heads, kv, 128)
    assert model.gqa.use_qk_norm and model.gqa.rope_theta == 1e6
    assert (model.moe.num_experts, model.moe.num_experts_per_tok, model.moe.moe_mlp_dim) == (128, 8, f)
    assert model.moe.shared_experts == 0 and model.moe.n_routing_groups == -1
    assert model.moe.routed_score_func == "softmax" and model.moe.norm_topk_prob
    assert cfg.vocab_size == 151936 and cfg.normalization_layer_epsilon == 1e-6
    # The model card's total (untied embedding and head): 30.5B / 235B.
    total = count_params(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))))
    assert total == pytest.approx(params, rel=2e-3), total


def test_proxy_has_the_30b_layer_shapes_and_tiny_resolves():
    full, proxy = resolve("model_name=qwen3-30b-a3b").model(), resolve("model_name=qwen3-moe-proxy").model()
    assert proxy.gqa == full.gqa and proxy.moe == full.moe and proxy.emb_dim == full.emb_dim
    assert proxy.num_decoder_layers < full.num_decoder_layers
    tiny = resolve("model_name=qwen3-moe-tiny").model()
    assert tiny.attention_type == "gqa" and tiny.gqa.num_kv_heads < tiny.gqa.num_heads


def test_gqa_defaults_are_multi_head_attention_over_emb_dim():
    gqa = resolve("decoder_block=custom", "attention_type=gqa", "emb_dim=64", "num_query_heads=4").gqa()
    assert (gqa.num_kv_heads, gqa.head_dim) == (4, 16)


BAD = [
    (["model_name=qwen3-moe-tiny", "n_routing_groups=4", "topk_routing_group=2"],
     "n_routing_groups=4 (from command line): group-limited routing is DeepSeek's; Qwen3-MoE"),
    (["model_name=qwen3-30b-a3b", "shared_experts=1"], "shared_experts=1 (from command line): must be 0 with decoder_block=qwen3_moe"),
    (["model_name=qwen3-moe-tiny", "routed_score_func=sigmoid"], "routes with a softmax"),
    (["model_name=qwen3-moe-tiny", "attention_type=mla"], "must be gqa with decoder_block=qwen3_moe"),
    (["model_name=qwen3-moe-tiny", "routed_bias=true"], "no selection bias"),
    (["model_name=qwen3-moe-tiny", "use_qk_norm=false"], "use_qk_norm=False (from command line): must be true"),
    (["model_name=deepseek3-tiny", "attention_type=gqa"], "must be mla with decoder_block=deepseek"),
    (["model_name=qwen3-moe-tiny", "num_kv_heads=3"], "num_kv_heads=3 (from command line): must divide num_query_heads=4"),
    (["model_name=qwen3-moe-tiny", "head_dim=15"], "GQA needs a positive even head dim"),
    (["model_name=qwen3-moe-tiny", "rope_factor=4"], "YaRN scaling is implemented for attention_type=mla only"),
    (["use_qk_norm=true"], "applies to attention_type=gqa"),
    (["attention_type=gqa_flash"], "must be one of"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o[1:] or o) for o, _ in BAD])
def test_bad_input_gives_one_clear_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        resolve(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_custom_block_allows_qwen_attention_with_deepseek_routing():
    cfg = resolve("model_name=qwen3-moe-tiny", "decoder_block=custom", "n_routing_groups=4",
                  "topk_routing_group=2", "shared_experts=1")
    assert cfg.model().moe.n_routing_groups == 4 and cfg.model().attention_type == "gqa"
