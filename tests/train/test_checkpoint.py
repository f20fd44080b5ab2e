"""Checkpoints: round trip, incomplete ones skipped, corrupt ones reported, and
``load_parameters`` refusing what does not fit.
"""

import dataclasses
import io
import json
import os
import shutil

import jax
import numpy as np
import pytest
from rich.console import Console

from dropless.config.sections import MeshConfig
from dropless.parallel import mesh as mesh_lib
from dropless.train import checkpoint as ckpt_lib
from dropless.train import optimizer as opt_lib
from dropless.train import step as step_lib
from dropless.train import loop
from dropless.train.loop import run_training

MODEL_KEYS = ("params", "router_bias")


def _abstract(model_cfg):
    """(init, abstract state, its shardings) of ``model_cfg``'s train state; nothing runs."""
    tx = opt_lib.make_optimizer(opt_lib.OptimizerConfig(), 10)
    _, init = step_lib.init_state_fn(model_cfg, tx, 0)
    abstract = jax.eval_shape(init)
    return init, abstract, mesh_lib.param_shardings(mesh_lib.make_mesh(MeshConfig()), abstract)


def _state(model_cfg):
    init, abstract, shardings = _abstract(model_cfg)
    return jax.jit(init, out_shardings=shardings)(), abstract, shardings


@pytest.fixture(scope="module")
def saved(tmp_path_factory, small_model):
    """A checkpoint directory with complete steps 2 and 4 of a freshly initialised state."""
    root = tmp_path_factory.mktemp("ckpt")
    state, abstract, shardings = _state(small_model)
    ckpt = ckpt_lib.Checkpointer(str(root / "checkpoints"), period=2)
    assert ckpt.save(2, state) and not ckpt.save(3, state)
    state4 = {**state, "step": state["step"] + 4}
    assert ckpt.save(4, state4)
    ckpt.close()
    return root, state4, abstract, shardings


def _copy(saved, tmp_path):
    root = saved[0]
    shutil.copytree(root / "checkpoints", tmp_path / "checkpoints")
    return ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), period=2)


def test_max_to_keep_keeps_the_newest(saved, tmp_path):
    """max_num_checkpoints_to_keep=2 over saves 2, 4, 6: step 2 is deleted."""
    _, state4, _, _ = saved
    ckpt = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), period=2, max_to_keep=2)
    for step in (2, 4, 6):
        assert ckpt.save(step, state4)
        timing = ckpt.last_timing
        assert timing.step == step and 0 <= timing.wait_s <= timing.blocked_s
    ckpt.close()
    ckpt = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), period=2)
    assert ckpt.complete_steps() == [4, 6] and not ckpt.incomplete_steps()
    ckpt.close()


def test_round_trip(saved, tmp_path):
    _, state4, abstract, shardings = saved
    ckpt = _copy(saved, tmp_path)
    assert ckpt.complete_steps() == [2, 4]
    restored = ckpt.restore(4, abstract, shardings)
    assert jax.tree.structure(restored) == jax.tree.structure(state4)
    jax.tree.map(np.testing.assert_array_equal, restored, state4)
    ckpt.close()


@pytest.mark.parametrize("pinned", [True, False])
def test_pinned_host_transfer_reaches_orbax_and_files_stay_the_same(saved, tmp_path, monkeypatch,
                                                                     pinned):
    """checkpoint_pinned_host_transfer: the copies to host are asked as pinned (Orbax's GPU
    default, forced on here since the CPU has no pinned_host memory to choose) or pageable;
    either checkpoint restores bit for bit, by the other setting too."""
    from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as base
    from orbax.checkpoint._src.serialization import replica_slices

    _, state4, abstract, shardings = saved
    asked = []
    transfer = replica_slices.transfer_arrays_to_host

    def spy(*args, **kwargs):
        asked.append(kwargs.get("enable_pinned_host_transfer"))
        return transfer(*args, **kwargs)

    monkeypatch.setattr(replica_slices, "transfer_arrays_to_host", spy)
    init = base.BasePyTreeCheckpointHandler.__init__

    def gpu_default(self, *args, enable_pinned_host_transfer=None, **kwargs):
        # Orbax's default on a GPU backend: on unless the caller says otherwise.
        on = True if enable_pinned_host_transfer is None else enable_pinned_host_transfer
        init(self, *args, enable_pinned_host_transfer=on, **kwargs)

    monkeypatch.setattr(base.BasePyTreeCheckpointHandler, "__init__", gpu_default)
    directory = str(tmp_path / "checkpoints")
    ckpt = ckpt_lib.Checkpointer(directory, period=2, pinned_host_transfer=pinned)
    assert ckpt.save(4, state4)
    ckpt.close()
    assert asked and set(asked) == {pinned}
    ckpt = ckpt_lib.Checkpointer(directory, period=2, pinned_host_transfer=not pinned)
    jax.tree.map(np.testing.assert_array_equal, ckpt.restore(4, abstract, shardings), state4)
    ckpt.close()


def test_checkpoint_without_manifest_counts_as_incomplete(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    os.remove(os.path.join(ckpt.step_dir(4), ckpt_lib.MANIFEST))
    assert ckpt.complete_steps() == [2] and ckpt.incomplete_steps() == [4]
    with pytest.raises(ckpt_lib.CheckpointError, match="incomplete"):
        ckpt.restore(4, *saved[2:])
    ckpt.close()


def _largest_file(step_dir):
    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs
             if f != ckpt_lib.MANIFEST]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage,match", [
    ("truncate", "truncated"),
    ("flip", "CRC32"),
    ("delete", "is missing"),
])
def test_corrupt_checkpoint_is_reported_not_loaded(saved, tmp_path, damage, match):
    ckpt = _copy(saved, tmp_path)
    victim = _largest_file(ckpt.step_dir(4))
    data = open(victim, "rb").read()
    if damage == "truncate":
        open(victim, "wb").write(data[: len(data) // 2])
    elif damage == "flip":
        open(victim, "wb").write(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:
        os.remove(victim)
    with pytest.raises(ckpt_lib.CheckpointError, match=match) as err:
        ckpt.restore(4, *saved[2:])
    assert "delete" in str(err.value) and ckpt.step_dir(4) in str(err.value)
    ckpt.close()


def test_verification_shares_cover_every_file_once(saved, tmp_path):
    """Process i of n checks files i, i+n, ...: exactly one share sees a damaged file."""
    step_dir = _copy(saved, tmp_path).step_dir(4)
    names = sorted(json.load(open(os.path.join(step_dir, ckpt_lib.MANIFEST)))["files"])
    assert len(names) >= 3
    victim = names[1]
    with open(os.path.join(step_dir, victim), "ab") as f:
        f.write(b"junk")
    for count in (1, 2, 3):
        failed = []
        for index in range(count):
            try:
                ckpt_lib.verify_manifest(step_dir, (index, count))
            except ckpt_lib.CheckpointError as e:
                assert victim in str(e)
                failed.append(index)
        assert failed == [1 % count]
    with pytest.raises(ckpt_lib.CheckpointError, match="truncated"):
        ckpt_lib.verify_everywhere(step_dir)  # one process: the whole manifest


def test_resume_refuses_a_corrupt_latest_checkpoint(saved, small_model, make_train, tmp_path):
    shutil.copytree(saved[0] / "checkpoints", tmp_path / "run" / "checkpoints")
    victim = _largest_file(str(tmp_path / "run" / "checkpoints" / "4"))
    open(victim, "ab").write(b"junk")
    with pytest.raises(ckpt_lib.CheckpointError, match="corrupt"):
        run_training(small_model, make_train(tmp_path, steps=6, checkpoint_period=2), MeshConfig(),
                     console=Console(file=io.StringIO()))


def test_load_parameters(saved, small_model):
    root, state4, abstract, shardings = saved
    step_dir = str(root / "checkpoints" / "4")
    loaded = ckpt_lib.load_parameters(step_dir, {k: abstract[k] for k in MODEL_KEYS},
                                      {k: shardings[k] for k in MODEL_KEYS})
    jax.tree.map(np.testing.assert_array_equal, loaded, {k: state4[k] for k in MODEL_KEYS})
    with pytest.raises(ckpt_lib.CheckpointError, match="no such checkpoint"):
        ckpt_lib.load_parameters(str(root / "checkpoints" / "7"), abstract, shardings)
    wider = dataclasses.replace(small_model, emb_dim=24)
    _, abstract_w, shardings_w = _abstract(wider)  # a target the checkpoint does not fit
    with pytest.raises(ckpt_lib.CheckpointError, match="could not be restored"):
        ckpt_lib.load_parameters(step_dir, {k: abstract_w[k] for k in MODEL_KEYS},
                                 {k: shardings_w[k] for k in MODEL_KEYS})


def test_loaded_parameters_skip_the_random_initialisation(saved, small_model, make_train, tmp_path,
                                                          monkeypatch):
    """``load_parameters_path``: the state holds the checkpoint's params and router bias
    bit for bit, the optimizer state and counters of a fresh start, and the random
    initialiser never runs (it does run, once, without the path)."""
    root, state4, _, _ = saved
    calls = []
    random_state = loop._random_state
    monkeypatch.setattr(loop, "_random_state", lambda s: calls.append(1) or random_state(s))
    one_step = dict(steps=1, enable_checkpointing=False, enable_tensorboard=False, seed=1)
    fresh = loop.build(small_model, make_train(tmp_path, **one_step), MeshConfig()).state
    assert calls == [1]
    built = loop.build(small_model, make_train(
        tmp_path, load_parameters_path=str(root / "checkpoints" / "4"), **one_step), MeshConfig())
    assert calls == [1]
    jax.tree.map(np.testing.assert_array_equal, {k: built.state[k] for k in MODEL_KEYS},
                 {k: state4[k] for k in MODEL_KEYS})
    rest = ("opt_state", "step", "skipped_steps")
    jax.tree.map(np.testing.assert_array_equal, {k: built.state[k] for k in rest},
                 {k: fresh[k] for k in rest})
