"""``nn.moe.fp8_rows_line``: te_fp8_blockwise with too few rows per expert says so once.

The line is printed at the start of ``dropless train`` and by ``--dry-run``; the
break-even (``FP8_BREAK_EVEN_ROWS``, about 550 rows per expert) is the arithmetic in
its comment, and the H200's measurements beside it (0.74x bf16 at 256 rows).
"""

from dropless.config.loader import load_config
from dropless.nn import moe


def _moe(**overrides):
    keys = [f"{k}={v}" for k, v in overrides.items()]
    return load_config(None, keys, environ={}).config.model().moe


def test_rows_per_local_expert_counts_the_expert_parallel_groups_tokens():
    cfg = _moe(model_name="deepseek3-proxy")  # 32 experts, top-8
    assert moe.rows_per_local_expert(cfg, 2 * 4096, 1) == 2 * 4096 * 8 / 32 == 2048
    assert moe.rows_per_local_expert(cfg, 2 * 4096, 8) == 8 * 2048  # 4 local experts, 8 ranks' tokens


def test_the_line_appears_below_the_break_even_and_only_for_the_fp8_kernels_recipe():
    fp8 = _moe(model_name="deepseek3-proxy", te_gmm_quantization="te_fp8_blockwise")
    assert moe.fp8_rows_line(fp8, 2048) is None  # the proxy's rows: FP8 pays (1.10x step)
    assert moe.fp8_rows_line(fp8, moe.FP8_BREAK_EVEN_ROWS) is None
    line = moe.fp8_rows_line(fp8, 256)
    assert line.startswith("te_gmm_quantization=te_fp8_blockwise: about 256 rows per expert")
    assert "te_gmm_quantization=te_no_quant" in line and "\n" not in line
    for recipe in ("te_no_quant", "te_mxfp8"):  # no kernels there: nothing to say about them
        assert moe.fp8_rows_line(_moe(model_name="deepseek3-proxy", te_gmm_quantization=recipe),
                                 256) is None


def test_dry_run_says_it_at_256_experts_on_one_device(capsys):
    """``dropless train --dry-run``, one device, 2 x 4096 tokens: 256 experts give 256 rows
    per expert, and the line says so (narrow experts, so the model fits an H200); the
    proxy's 32 experts (2,048 rows) get none (the unit test above: one dry run is ~12 s)."""
    from dropless import cli

    def lines(*keys):
        code = cli.main(["train", "--dry-run", "--device", "h200", "model_name=deepseek3-proxy",
                         "te_gmm_quantization=te_fp8_blockwise", "per_device_batch_size=2",
                         "moe_mlp_dim=256", *keys])
        out = capsys.readouterr().out
        assert code == 0, out
        return [ln for ln in out.splitlines() if "rows per expert" in ln]

    (line,) = lines("num_experts=256")
    assert "about 256 rows per expert" in line
