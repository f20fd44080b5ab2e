"""``remat_policy=custom`` and the FP8 codes only dropless makes.

A MaxText recipe's custom policy (``tests/config/seed_recipe.yml``, with FP8) cannot
list ``moe_fp8_weights``, ``moe_fp8_input_codes`` or ``fp8_dot_codes``, so its backward
pass quantizes those operands again (``test_remat_kernels.py`` counts the kernels). The
config keys exist, reach the policy, and the start of a run and ``--dry-run`` say in one
line which of the codes this model makes are not kept (``remat.fp8_codes_recomputed_line``).
"""

import pytest

from dropless import cli
from dropless.config.loader import load_config
from dropless.train import remat

FP8 = ("quantization=te_fp8_currentscaling", "fp8_min_dim=0",
       "te_gmm_quantization=te_fp8_blockwise")


def _line(*keys):
    return remat.fp8_codes_recomputed_line(
        load_config(overrides=["model_name=deepseek3-tiny", *keys]).config.model())


def test_custom_policy_names_each_fp8_code_it_does_not_keep():
    line = _line("remat_policy=custom", "decoder_layer_input=offload", *FP8)
    assert line == (
        "remat_policy=custom does not keep moe_fp8_weights, moe_fp8_input_codes (where the "
        "FP8 expert kernels run); fp8_dot_codes (the FP8 dense products): the backward pass "
        "quantizes those operands again; moe_fp8_weights=device moe_fp8_input_codes=device "
        "fp8_dot_codes=device keeps them (remat_policy=minimal does)")
    # Listed (kept, offloaded, or recomputed by choice): not named.
    assert "fp8_dot_codes" not in _line("remat_policy=custom", "fp8_dot_codes=remat", *FP8)
    only = _line("remat_policy=custom", "moe_fp8_weights=offload", "fp8_dot_codes=device", *FP8)
    assert " moe_fp8_input_codes (where" in only and "moe_fp8_weights" not in only
    assert _line("remat_policy=custom", "moe_fp8_weights=device", "moe_fp8_input_codes=device",
                 "fp8_dot_codes=device", *FP8) is None
    # The weights quantized once per step by the trainer: their codes are not the layer's.
    cfg = load_config(overrides=["model_name=deepseek3-tiny", "remat_policy=custom", *FP8,
                                 "fp8_dot_codes=device"]).config.model()
    assert "moe_fp8_weights" not in remat.fp8_codes_recomputed_line(cfg, weight_codes_given=True)
    assert "moe_fp8_weights" in remat.fp8_codes_recomputed_line(cfg)


@pytest.mark.parametrize("keys", [
    ("remat_policy=minimal", *FP8),  # keeps them all
    ("remat_policy=full", *FP8),  # keeps nothing, by design: recomputing is the policy
    ("remat_policy=custom",),  # bf16: no codes
    ("remat_policy=custom", "te_gmm_quantization=te_fp8_blockwise", "gmm_fp8_impl=emulate"),
    ("remat_policy=custom", "te_gmm_quantization=te_mxfp8"),  # emulated: no codes
    # every dense matmul of the tiny model is under 4096 wide: none in FP8
    ("remat_policy=custom", "quantization=te_fp8_currentscaling"),
], ids=str)
def test_no_line_where_no_code_goes_unkept(keys):
    assert _line(*keys) is None


def test_the_keys_reach_the_policy():
    cfg = load_config(overrides=["remat_policy=custom", "moe_fp8_input_codes=device",
                                 "fp8_dot_codes=offload"]).config
    assert dict(cfg.model().remat_custom) == {"moe_fp8_input_codes": "device",
                                              "fp8_dot_codes": "offload"}
    remat.checkpoint_policy("custom", cfg.model().remat_custom)  # names known to the policy


def test_dry_run_says_it_once(capsys):
    def lines(*keys):
        code = cli.main(["train", "--dry-run", "model_name=deepseek3-tiny",
                         "remat_policy=custom", *FP8, *keys])
        out = capsys.readouterr().out
        assert code == 0
        return [ln for ln in out.splitlines() if ln.startswith("remat_policy=custom")]

    (line,) = lines()
    assert line.endswith("keeps them (remat_policy=minimal does)")
    assert lines("moe_fp8_weights=device", "moe_fp8_input_codes=device",
                 "fp8_dot_codes=device") == []
