"""Training with FP8 on both the dense and the grouped GEMMs ends where unquantized training does.

Default suite: the small trainer model (``conftest.SMALL_MODEL``) for a few
dozen steps on Markov data, unquantized and with ``quantization:
te_fp8_currentscaling`` + ``te_gmm_quantization: te_mxfp8``; the FP8 run must
learn (its loss falls by as much) and end close to the unquantized one.

``slow`` (DROPLESS_SLOW=1, about 5 minutes on 2 cores): ``deepseek3-tiny``
as configured (float32 activations) for 300 steps, unquantized and with
each grouped-GEMM recipe next to the FP8 dense layers; each FP8 run's final
LM loss (mean of the last tenth of the steps) within 2% of the unquantized
one's.
"""

import dataclasses
import io

import jax
import numpy as np
import pytest
from rich.console import Console

from dropless.config.loader import load_config
from dropless.config.sections import MeshConfig
from dropless.train.loop import build, run_training

FP8 = dict(quantization="te_fp8_currentscaling", fp8_min_dim=0)  # every dense matmul: small dims


def _train(model, train):
    return run_training(model, train, MeshConfig(), console=Console(file=io.StringIO()))


def _fp8(model, recipe):
    return dataclasses.replace(model, **FP8,
                               moe=dataclasses.replace(model.moe, gmm_quantization=recipe))


def _losses(model, train):
    """LM loss of each step, through ``loop.build`` (no run files: this test is about numbers)."""
    built = build(model, train, MeshConfig())
    state, losses = built.state, []
    for _ in range(train.steps):
        state, metrics = built.step_fn(state, next(built.batches))
        losses.append(metrics["lm_loss"])
    return np.asarray(jax.device_get(losses))


def test_fp8_small_model_learns_like_unquantized(tmp_path, small_model, make_train):
    train = make_train(tmp_path, steps=40)
    plain = _losses(small_model, train)
    fp8 = _losses(_fp8(small_model, "te_mxfp8"), train)
    assert np.isfinite(fp8).all()
    end_plain, end_fp8 = plain[-8:].mean(), fp8[-8:].mean()
    assert fp8[0] - end_fp8 > 0.8 * (plain[0] - end_plain)
    assert abs(end_fp8 - end_plain) < 0.03 * end_plain
    assert not np.array_equal(fp8, plain)  # FP8 really ran


@pytest.mark.slow(reason="about 5 minutes on 2 cores")
def test_deepseek3_tiny_300_steps_fp8_within_2_percent(tmp_path):
    cfg = load_config(None, ["model_name=deepseek3-tiny", "steps=300", "enable_checkpointing=false",
                             "enable_tensorboard=false", f"base_output_directory={tmp_path}"],
                      environ={}).config
    model, train = cfg.model(), cfg.train()
    base = _train(model, dataclasses.replace(train, run_name="plain")).final_lm_loss_avg
    for recipe in ("te_mxfp8", "te_fp8_blockwise"):
        result = _train(_fp8(model, recipe), dataclasses.replace(train, run_name=recipe))
        assert result.skipped_steps == 0
        rel = abs(result.final_lm_loss_avg - base) / base
        print(f"{recipe}: final LM loss {result.final_lm_loss_avg:.4f} vs {base:.4f} ({rel:.2%})")
        assert rel < 0.02, (recipe, result.final_lm_loss_avg, base)
