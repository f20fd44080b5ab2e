"""The trainer on an expert=8 mesh: a step whose EP buffers overflow is skipped on device.

Every token is routed to experts 0 and 1 (ranks 0 and 1) by the balancing
bias. With ``ragged_buffer_factor=1.0`` rank 0 is sent 8 x T rows where the
buffer holds the balanced 2 x T: the step must report the overflow per layer
(and the factor 4.0 that would have held it) and leave parameters, optimizer
state and bias untouched. With factor -1 the same step is applied. Two
microbatches, so the per-layer maxima go through gradient accumulation.

Then the whole training loop (``run_training``) on the same model, train config
and meshes, so its step programs are the ones compiled above (persistent cache
hits): with exact buffers it trains; with factor 1.0 every step is skipped and
counted, and ``ep_overflow_policy="warn"`` says so and goes on.
"""

import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

from dropless.config.sections import (
    DataConfig, MeshConfig, MLAConfig, ModelConfig, MoEConfig, OptimizerConfig, TrainConfig,
)
from dropless.train import loop

MODEL = ModelConfig(
    vocab_size=32, emb_dim=16, num_decoder_layers=2, first_num_dense_layers=1, mlp_dim=32,
    remat_policy="none",
    mla=MLAConfig(num_heads=2, q_lora_rank=0, kv_lora_rank=8, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8),
    moe=MoEConfig(num_experts=8, num_experts_per_tok=2, moe_mlp_dim=16, shared_experts=1,
                  routed_score_func="sigmoid", routed_bias=True, gmm_backend="xla"),
)
TRAIN = TrainConfig(
    steps=4, per_device_batch_size=1, gradient_accumulation_steps=2, max_target_length=8,
    enable_checkpointing=False, enable_tensorboard=False,
    optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps_fraction=0.0),
    data=DataConfig(dataset_type="markov", data_seed=1),
)


def _mesh(factor, **keys):
    return MeshConfig(ici_fsdp_parallelism=1, ici_expert_parallelism=8,
                      ragged_buffer_factor=factor, ep_exchange="auto", **keys)


def _one_skewed_step(factor):
    built = loop.build(MODEL, TRAIN, _mesh(factor))
    state = built.state
    bias = jnp.zeros(MODEL.moe.num_experts).at[:2].set(100.0)
    state = {**state, "router_bias": jax.tree.map(lambda b: b + bias, state["router_bias"])}
    before = jax.device_get(state)
    after, metrics = built.step_fn(state, next(built.batches))
    return before, jax.device_get(after), jax.device_get(metrics)


def _same(a, b):
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


@pytest.mark.parametrize("factor", [1.0, -1.0])
def test_overflowing_step_is_skipped(factor):
    before, after, m = _one_skewed_step(factor)
    overflow_L = np.asarray(m["overflow_tokens"])
    assert overflow_L.shape == (1,)  # one MoE layer
    assert int(after["step"]) == 1
    if factor == 1.0:
        assert overflow_L[0] > 0 and not bool(m["applied"]) and bool(m["finite"])
        assert float(np.asarray(m["buffer_factor_needed"])[0]) == 4.0
        assert int(after["skipped_steps"]) == 1
        for key in ("params", "opt_state", "router_bias"):
            assert _same(before[key], after[key]), key
    else:
        assert overflow_L[0] == 0 and bool(m["applied"])
        assert int(after["skipped_steps"]) == 0
        assert not _same(before["params"], after["params"])
        assert m["ep_rows_saved"] == 0 and m["ep_rows_sent"] > 0  # experts 0, 1 on 2 ranks


def test_training_loop_trains_or_skips_every_overflowing_step(tmp_path):
    """``run_training`` with exact buffers trains (no step skipped, no warning, the loss
    falls); with factor 1.0 (the balanced load) random routing is never balanced enough,
    so every step is skipped and counted, and the run warns and finishes."""
    out = {}
    for name, factor in (("exact", -1.0), ("tight", 1.0)):
        console = Console(file=io.StringIO(), width=200)
        train = dataclasses.replace(TRAIN, base_output_directory=str(tmp_path), run_name=name)
        r = loop.run_training(MODEL, train, _mesh(factor, ep_overflow_policy="warn"), console=console)
        out[name] = [r.initial_loss, r.final_loss, r.skipped_steps, r.final_step,
                     "receive buffer overflow" in console.file.getvalue()]
    initial, final, skipped, steps, warned = out["exact"]
    assert skipped == 0 and steps == TRAIN.steps and final < initial and not warned
    initial, final, skipped, steps, warned = out["tight"]
    assert skipped == TRAIN.steps and warned  # random routing is never perfectly balanced
