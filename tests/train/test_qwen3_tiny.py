"""The qwen3-moe-tiny preset, resolved through the config loader as a user's
run would be, trains on CPU: its loss falls within a few steps."""

from preset_training import assert_loss_falls

from dropless.config.loader import load_config

STEPS = 24


def test_qwen3_moe_tiny_trains_and_its_loss_falls():
    """Markov data (Dirichlet 0.03 rows over 256 tokens): the first losses sit near
    ln 256 = 5.5 and learning the frequent transitions lowers them quickly. Two
    layers and short sequences keep the compile small; the structure (GQA 4/2
    heads with q/k norm, softmax top-2 of 8 experts, no shared expert) is the
    preset's."""
    cfg = load_config(None, ["model_name=qwen3-moe-tiny", f"steps={STEPS}", "num_decoder_layers=2",
                             "max_target_length=32", "per_device_batch_size=8", "hardware=cpu"],
                      environ={}).config
    model = cfg.model()
    assert model.attention_type == "gqa" and model.moe.shared_experts == 0
    assert_loss_falls(cfg, STEPS)
