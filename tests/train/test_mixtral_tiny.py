"""The mixtral-tiny preset, resolved through the config loader as a user's run
would be, trains on CPU: its loss falls within a few steps."""

from preset_training import assert_loss_falls

from dropless.config.loader import load_config

STEPS = 24


def test_mixtral_tiny_trains_and_its_loss_falls():
    """Markov data (Dirichlet 0.03 rows over 256 tokens): the first losses sit near
    ln 256 = 5.5 and learning the frequent transitions lowers them quickly. The
    structure (GQA 4/2 heads without q/k norm, every layer MoE, softmax top-2 of 8
    experts renormalised, no shared expert) is the preset's, unchanged."""
    cfg = load_config(None, ["model_name=mixtral-tiny", f"steps={STEPS}", "hardware=cpu"],
                      environ={}).config
    model = cfg.model()
    assert model.attention_type == "gqa" and not model.gqa.use_qk_norm
    assert model.first_num_dense_layers == 0 and model.moe.shared_experts == 0
    assert_loss_falls(cfg, STEPS)
