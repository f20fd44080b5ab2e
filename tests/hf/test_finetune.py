"""Fine-tuning from hf_model_path: the trainer starts from the directory's
weights and its loss falls."""

import os

import jax
import numpy as np
import pytest
from hf_fixture import read_all

from dropless import cli
from dropless.config.loader import load_config
from dropless.train import loop


def _cfg(fixtures, tmp_path, *extra):
    return load_config(None, [
        f"hf_model_path={os.path.join(fixtures, 'published')}", "hardware=cpu", "steps=8",
        "per_device_batch_size=8", "max_target_length=24", "learning_rate=3e-3",
        "warmup_steps_fraction=0", "enable_checkpointing=false", "enable_tensorboard=false",
        f"base_output_directory={tmp_path}", "run_name=ft", "remat_policy=none", *extra]).config


def test_fine_tuning_starts_from_the_hf_weights_and_loss_falls(fixtures, tmp_path, monkeypatch):
    """The trainer's parts (``loop.build``, as ``train`` and ``profile`` use them)
    hold the directory's weights, never initialised at random first, and 8
    train steps lower the loss."""
    cfg = _cfg(fixtures, tmp_path)
    monkeypatch.setattr(loop, "_random_state", lambda s: pytest.fail("random init before loading"))
    built = loop.build(cfg.model(), cfg.train(), cfg.mesh())
    embed = read_all(os.path.join(fixtures, "published"))["model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(jax.device_get(built.state["params"]["embed"]["embedding"])),
                                  embed.astype(np.float32))
    state, losses = built.state, []
    for _ in range(8):
        state, metrics = built.step_fn(state, next(built.batches))
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all()
    # Markov data over a 128-token vocabulary: the random-weight model starts far
    # above the data's entropy, so 8 AdamW steps at 3e-3 must lower the loss clearly.
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.1, losses


def test_train_with_a_broken_directory_is_one_line_exit_2(fixtures, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(open(os.path.join(fixtures, "published", "config.json")).read())
    code = cli.main(["train", f"hf_model_path={bad}", "hardware=cpu", "steps=1",
                     f"base_output_directory={tmp_path}", "enable_checkpointing=false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no *.safetensors files" in err and "\n" not in err, err
