"""hf_model_path on 8 devices: each shard reads its own region, and the model
run expert-parallel gives transformers' logits.

What the single-device tests in ``tests/hf`` cannot show: on one device every
shard index covers the whole leaf, so the region arithmetic (layer, expert,
row and column offsets, FP8 block scales of a partial region) never runs.
"""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from dropless.config.loader import load_config
from dropless.hf.load import load_hf
from dropless.parallel import mesh as mesh_lib
from dropless.train import step as step_lib
from dropless.train.forward import forward_logits

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "hf", "fixtures")


def _config(layout, *extra):
    return load_config(None, [f"hf_model_path={os.path.join(FIXTURES, layout)}", "hardware=cpu",
                              "ici_fsdp_parallelism=2", "ici_expert_parallelism=4", *extra],
                       environ={}).config  # DROPLESS_CPU_DEVICES is not a config key


def _abstract(model_cfg):
    abstract_model = nnx.eval_shape(lambda: step_lib.build_model(model_cfg, 0))
    _, params, bias, _ = step_lib.split_model(abstract_model)
    return {"params": params, "router_bias": bias}


def test_sharded_load_equals_single_device_load():
    cfg = _config("fp8_mtp")
    model_cfg = cfg.model()
    abstract = _abstract(model_cfg)
    mesh = mesh_lib.make_mesh(cfg.mesh())
    sharded = load_hf(os.path.join(FIXTURES, "fp8_mtp"), model_cfg, abstract,
                      mesh_lib.param_shardings(mesh, abstract))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    whole = load_hf(os.path.join(FIXTURES, "fp8_mtp"), model_cfg, abstract,
                    jax.tree.map(lambda _: one, abstract))
    split = 0
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(sharded),
                                 jax.tree_util.tree_leaves_with_path(whole)):
        split += not a.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    assert split >= 10  # the expert weights and the larger kernels are split over devices


@pytest.mark.parametrize("fixture", [".", "qwen3_moe", "mixtral"])  # DeepSeek-V3, Qwen3-MoE, Mixtral
def test_expert_parallel_forward_matches_transformers(fixture):
    cfg = _config(os.path.join(fixture, "published"))
    tokens = np.load(os.path.join(FIXTURES, fixture, "tokens.npy"))
    batch = np.tile(tokens, (4, 1))  # 8 sequences: one per batch shard
    logits = forward_logits(cfg.model(), cfg.train(), cfg.mesh(), batch)
    ref = np.tile(np.load(os.path.join(FIXTURES, fixture, "logits.npy")), (4, 1, 1))
    assert np.linalg.norm(logits - ref) / np.linalg.norm(ref) < 1e-4  # as tests/hf/test_parity.py
    np.testing.assert_array_equal(logits.argmax(-1), ref.argmax(-1))


