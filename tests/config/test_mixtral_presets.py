"""Mixtral presets carry the published shapes; decoder_block=mixtral refuses what
the model cannot be, each with one line naming the key."""

import pytest
from flax import nnx

from dropless.config.loader import ConfigError, load_config
from dropless.nn.model import Transformer, count_params


def resolve(*overrides):
    return load_config(None, list(overrides), environ={}).config


# (preset, D, layers, q heads, vocab, expert hidden, published parameter count)
PUBLISHED = [
    ("mixtral-8x7b", 4096, 32, 32, 32000, 14336, 46.7e9),
    ("mixtral-8x22b", 6144, 56, 48, 32768, 16384, 140.6e9),
]


@pytest.mark.parametrize("name,d,layers,heads,vocab,f,params", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_presets_have_the_published_shapes(name, d, layers, heads, vocab, f, params):
    cfg = resolve(f"model_name={name}")
    model = cfg.model()
    assert (cfg.emb_dim, cfg.num_decoder_layers, cfg.first_num_dense_layers) == (d, layers, 0)
    assert model.attention_type == "gqa" and cfg.decoder_block == "mixtral"
    assert (model.gqa.num_heads, model.gqa.num_kv_heads, model.gqa.head_dim) == (heads, 8, 128)
    assert not model.gqa.use_qk_norm and model.gqa.rope_theta == 1e6
    assert (model.moe.num_experts, model.moe.num_experts_per_tok, model.moe.moe_mlp_dim) == (8, 2, f)
    assert model.moe.shared_experts == 0 and model.moe.n_routing_groups == -1
    assert model.moe.routed_score_func == "softmax" and model.moe.norm_topk_prob
    assert cfg.vocab_size == vocab and cfg.normalization_layer_epsilon == 1e-5
    # The model card's total (untied embedding and head): 46.7B / 140.6B, given to
    # 3 digits, so within 0.5% (the count is 46.70B / 140.63B).
    total = count_params(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))))
    assert total == pytest.approx(params, rel=5e-3), total


def test_proxy_has_the_8x7b_layer_shapes():
    full, proxy = resolve("model_name=mixtral-8x7b").model(), resolve("model_name=mixtral-proxy").model()
    assert proxy.gqa == full.gqa and proxy.moe == full.moe and proxy.emb_dim == full.emb_dim
    assert proxy.vocab_size == full.vocab_size and proxy.num_decoder_layers < full.num_decoder_layers


def test_tiny_resolves_to_the_same_structure():
    tiny, full = resolve("model_name=mixtral-tiny").model(), resolve("model_name=mixtral-8x7b").model()
    assert tiny.attention_type == "gqa" and not tiny.gqa.use_qk_norm
    assert tiny.gqa.num_kv_heads < tiny.gqa.num_heads and tiny.first_num_dense_layers == 0
    fields = ("shared_experts", "routed_score_func", "norm_topk_prob", "routed_bias", "num_experts_per_tok")
    assert all(getattr(tiny.moe, k) == getattr(full.moe, k) for k in fields)


BAD = [
    (["model_name=mixtral-tiny", "n_routing_groups=4", "topk_routing_group=2"],
     "n_routing_groups=4 (from command line): group-limited routing is DeepSeek's; Mixtral"),
    (["model_name=mixtral-8x7b", "shared_experts=1"], "shared_experts=1 (from command line): must be 0 with decoder_block=mixtral"),
    (["model_name=mixtral-tiny", "use_qk_norm=true"], "use_qk_norm=True (from command line): must be false with decoder_block=mixtral"),
    (["model_name=mixtral-tiny", "first_num_dense_layers=1"], "every Mixtral layer is MoE"),
    (["model_name=mixtral-tiny", "routed_score_func=sigmoid"], "Mixtral routes with a softmax"),
    (["model_name=mixtral-tiny", "norm_topk_prob=false"], "Mixtral renormalises its top-k weights"),
    (["model_name=mixtral-tiny", "attention_type=mla"], "must be gqa with decoder_block=mixtral"),
    (["model_name=mixtral-tiny", "routed_bias=true"], "no selection bias"),
    (["model_name=mixtral-tiny", "mtp_num_layers=1"], "no multi-token prediction"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o[1:]) for o, _ in BAD])
def test_bad_input_gives_one_clear_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        resolve(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value)
