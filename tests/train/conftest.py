"""Small model and train configs shared by the trainer tests.

The model has every structural part of DeepSeek-V3 (MLA with q low-rank and
the decoupled rope key, one dense then MoE layers, shared expert, sigmoid
group-limited routing with the balancing bias) at sizes that compile and run
in seconds on two CPU cores.

XLA:CPU's optimisation level for these compile-bound tests is set once for
the whole suite, in ``tests/conftest.py``.
"""

import dataclasses

import pytest

from dropless.config.sections import (
    DataConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    TrainConfig,
)

SMALL_MODEL = ModelConfig(
    vocab_size=32,
    emb_dim=16,
    num_decoder_layers=3,
    first_num_dense_layers=1,
    mlp_dim=32,
    remat_policy="none",
    mla=MLAConfig(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8),
    moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_mlp_dim=16, shared_experts=1,
                  routed_score_func="sigmoid", n_routing_groups=2, topk_routing_group=1,
                  routed_bias=True, routed_bias_update_rate=1e-3, seq_aux_loss_weight=1e-3,
                  gmm_backend="xla"),
)


def small_train(tmp_path, **overrides) -> TrainConfig:
    """A short markov run writing under ``tmp_path``; any field can be overridden."""
    base = TrainConfig(
        steps=40,
        per_device_batch_size=8,
        max_target_length=16,
        run_name="run",
        base_output_directory=str(tmp_path),
        checkpoint_period=10,
        max_num_checkpoints_to_keep=0,
        enable_tensorboard=True,
        optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps_fraction=0.1),
        data=DataConfig(dataset_type="markov", markov_concentration=0.1, data_seed=3),
    )
    return dataclasses.replace(base, **overrides)


@pytest.fixture(scope="session")
def small_model():
    return SMALL_MODEL


@pytest.fixture(scope="session")
def make_train():
    """``small_train`` as a fixture, for tests and module-scoped fixtures."""
    return small_train
