"""``checkpoint_device_snapshot``: a save copies the state on the device and Orbax
saves the copy from a background thread.

What these tests pin down: the copy owns new buffers (the train step donates
the state, so a checkpoint of the state itself would be read after its buffers
were given away); a failure of the background save is raised as
``CheckpointSaveError`` at ``wait``/``close``, never lost; while the background
save runs nobody else touches Orbax's manager; a run with the key resumes
from its saves to the same bits and has its last save complete when it
returns; a device without room for the copy refuses the run before its first
step, and several processes are refused.
"""

import errno
import io
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from rich.console import Console

from dropless.config.loader import ConfigError
from dropless.config.sections import MeshConfig
from dropless.parallel import mesh as mesh_lib
from dropless.train import checkpoint as ckpt_lib
from dropless.train import loop
from dropless.train import metrics as metrics_lib
from dropless.train import optimizer as opt_lib
from dropless.train import step as step_lib
from dropless.train.loop import run_training

GiB = 2**30


def _state(step):
    """A train state of the checkpoint's layout, bf16 and float32 leaves, values set by ``step``."""
    return {"params": {"w": jnp.full((4, 4), step, jnp.bfloat16)}, "router_bias": jnp.arange(2.0) + step,
            "opt_state": {"mu": jnp.full((4, 4), step / 3, jnp.float32)}, "step": jnp.asarray(step),
            "skipped_steps": jnp.asarray(0)}


def _abstract(state):
    return (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state),
            jax.tree.map(lambda x: x.sharding, state))


# The train step's contract: the state it is given is donated (its buffers reused or freed).
_donating_step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)


def test_snapshot_owns_new_buffers_with_the_same_values_and_shardings():
    state = _state(5)
    copy = ckpt_lib.snapshot(state)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(copy)):
        assert y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
        assert y.sharding.is_equivalent_to(x.sharding, x.ndim) and y.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


class _HeldHandoff:
    """Holds Orbax's save of each snapshot in the handoff thread until ``release``; records
    whether the manager was asked anything meanwhile (only that thread may use it)."""

    def __init__(self, monkeypatch):
        self.go, self.started, self.touched = threading.Event(), threading.Event(), []
        save, busy = ocp.CheckpointManager.save, ocp.CheckpointManager.is_saving_in_progress

        def held_save(manager, *args, **kwargs):
            assert threading.current_thread().name.startswith("ckpt-snapshot")
            self.started.set()
            self.go.wait(60)
            return save(manager, *args, **kwargs)

        def watched_busy(manager):
            if self.started.is_set() and not self.go.is_set():
                self.touched.append("is_saving_in_progress")
            return busy(manager)

        monkeypatch.setattr(ocp.CheckpointManager, "save", held_save)
        monkeypatch.setattr(ocp.CheckpointManager, "is_saving_in_progress", watched_busy)

    def release(self):
        self.go.set()


def _save_then_step(directory, monkeypatch):
    """Save step 2 with a device snapshot, run three donated steps while Orbax's save of it
    is held back, then let it go; (checkpointer, the state at step 2 on the host)."""
    held = _HeldHandoff(monkeypatch)
    ckpt = ckpt_lib.Checkpointer(directory, period=2, device_snapshot=True)
    state = saved = _state(2)
    at_save = jax.device_get(_state(2))  # not of ``saved``: a host view of it on CPU would stop its donation
    assert ckpt.save(2, saved)
    assert held.started.wait(60)
    for _ in range(3):
        state = _donating_step(state)
        ckpt.poll()  # the loop polls every step: it must leave the manager to the handoff thread
    jax.block_until_ready(state)
    assert all(x.is_deleted() for x in jax.tree.leaves(saved))  # the step did take its buffers
    held.release()
    ckpt.wait()
    assert not held.touched
    return ckpt, at_save


def test_the_saved_state_is_the_one_at_the_save_not_after_later_donated_steps(tmp_path, monkeypatch):
    """Orbax reads the snapshot only after three steps donated the state it was taken from;
    the checkpoint restores bit for bit to the state at the save."""
    directory = str(tmp_path / "checkpoints")
    ckpt, at_save = _save_then_step(directory, monkeypatch)
    assert ckpt.complete_steps() == [2]
    timing = ckpt.last_timing
    assert timing.step == 2 and 0 <= timing.wait_s <= timing.blocked_s
    step, seconds = ckpt.take_handoff_seconds()
    assert step == 2 and seconds > 0 and ckpt.take_handoff_seconds() is None
    ckpt.close()
    reader = ckpt_lib.Checkpointer(directory, period=2)
    restored = reader.restore(2, *_abstract(_state(0)))
    reader.close()
    jax.tree.map(lambda got, want: np.testing.assert_array_equal(np.asarray(got), want), restored, at_save)


def test_without_the_copy_the_donated_state_is_gone(tmp_path, monkeypatch):
    """The control of the test above: handing Orbax the state itself, the donated steps free
    its buffers before Orbax reads them and the save fails. So the test above sees aliasing."""
    monkeypatch.setattr(ckpt_lib, "snapshot", lambda state: state)
    with pytest.raises(ckpt_lib.CheckpointSaveError, match="deleted"):
        _save_then_step(str(tmp_path / "checkpoints"), monkeypatch)


def _failing_save(monkeypatch, failing_step):
    real = ocp.CheckpointManager.save

    def save(manager, step, *args, **kwargs):
        assert threading.current_thread().name.startswith("ckpt-snapshot")
        if step == failing_step:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(manager, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)


@pytest.mark.parametrize("seen_at", ["wait", "close"])
def test_a_failed_background_save_is_raised_at_wait_or_close(tmp_path, monkeypatch, seen_at):
    _failing_save(monkeypatch, failing_step=4)
    directory = tmp_path / "checkpoints"
    ckpt = ckpt_lib.Checkpointer(str(directory), period=2, device_snapshot=True, per_save_bytes=3 * GiB)
    assert ckpt.save(2, _state(2))
    assert ckpt.save(4, _state(4))  # handed off: its failure comes later
    with pytest.raises(ckpt_lib.CheckpointSaveError) as info:
        getattr(ckpt, seen_at)()
    e = info.value
    assert e.step == 4 and e.intact == [2]
    for needle in ("checkpoint save at step 4 failed", "No space left on device (errno 28)",
                   "a save writes up to 3.00 GiB", "the same command resumes from step 2"):
        assert needle in str(e), (needle, str(e))
    ckpt.close()  # closed by the failure: nothing more to report
    assert ckpt_lib.complete_steps_in(str(directory)) == [2]



def _run(small_model, make_train, tmp_path, name, **overrides):
    train = make_train(tmp_path, run_name=name, checkpoint_period=2, enable_tensorboard=False, **overrides)
    return run_training(small_model, train, MeshConfig(), console=Console(file=io.StringIO(), width=140))


def _checkpoints(result, small_model):
    """{step: state on the host} of every complete checkpoint of a run."""
    tx = opt_lib.make_optimizer(opt_lib.OptimizerConfig(), 10)
    abstract = jax.eval_shape(step_lib.init_state_fn(small_model, tx, 0)[1])
    shardings = mesh_lib.param_shardings(mesh_lib.make_mesh(MeshConfig()), abstract)
    ckpt = ckpt_lib.Checkpointer(f"{result.run_dir}/checkpoints", period=2)
    out = {step: jax.device_get(ckpt.restore(step, abstract, shardings)) for step in ckpt.complete_steps()}
    ckpt.close()
    return out


def test_a_run_with_snapshots_resumes_to_the_same_bits(small_model, make_train, tmp_path):
    """Six steps saved every two with snapshots: the last save is complete when the run
    returns and the background saves' seconds reach the metrics. Then step 6 is removed and
    the run resumed from step 4's checkpoint: step 6 again, the same bits (a checkpoint
    holding any other step's state would not give them)."""
    first = _run(small_model, make_train, tmp_path, "snap", steps=6, checkpoint_device_snapshot=True)
    want = _checkpoints(first, small_model)
    assert sorted(want) == [2, 4, 6]
    rows = metrics_lib.read_jsonl(first.metrics_path)
    background = [r for r in rows if "checkpoint_background_s" in r]
    # Save 2's background save ended by save 4 at the latest (which waits for it).
    assert background and 3 <= background[0]["step"] <= 5
    assert all(r["checkpoint_background_s"] > 0 for r in background)
    assert first.checkpoint_saves == 3 and first.checkpoint_blocked_s > 0
    shutil.rmtree(f"{first.run_dir}/checkpoints/6")
    resumed = _run(small_model, make_train, tmp_path, "snap", steps=6, checkpoint_device_snapshot=True)
    assert resumed.resumed_from == 4 and resumed.final_step == 6
    jax.tree.map(np.testing.assert_array_equal, _checkpoints(resumed, small_model)[6], want[6])


def test_a_device_without_room_for_the_copy_is_refused_before_the_first_step(small_model, make_train,
                                                                              tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "_memory_limit", lambda device: 1)
    # steps=6 as above: the room check compiles the same step program (a cache hit).
    with pytest.raises(ConfigError) as info:
        _run(small_model, make_train, tmp_path, "full", steps=6, checkpoint_device_snapshot=True)
    text = str(info.value)
    assert "checkpoint_device_snapshot=true" in text and "set checkpoint_device_snapshot=false" in text
    assert "\n" not in text
    assert metrics_lib.read_jsonl(str(tmp_path / "full" / "metrics.jsonl")) == []


def _donating_train_step():
    """A step with the train step's form (shardings in and out, the state donated), its state and batch."""
    sharding = jax.sharding.NamedSharding(mesh_lib.make_mesh(MeshConfig()), jax.sharding.PartitionSpec())

    def room_step(state, batch):
        return jax.tree.map(lambda x: x + batch.sum().astype(x.dtype), state), batch.sum()

    step_fn = jax.jit(room_step, in_shardings=(sharding, sharding), out_shardings=(sharding, None),
                      donate_argnums=0)
    return step_fn, jax.device_put(_state(1), sharding), jax.device_put(jnp.ones((2, 3)), sharding)


def test_the_room_is_the_compiled_peak_plus_one_state(monkeypatch):
    from dropless.perf import memory

    step_fn, state, batch = _donating_train_step()
    need = (memory.compiled_bytes(step_fn.lower(state, batch).compile())["peak"]
            + ckpt_lib.state_bytes_per_device(state))
    assert ckpt_lib.state_bytes_per_device(state) == 4 * 4 * 2 + 2 * 4 + 4 * 4 * 4 + 4 + 4
    monkeypatch.setattr(loop, "_memory_limit", lambda device: need)
    loop._check_snapshot_room(step_fn, state, batch)
    monkeypatch.setattr(loop, "_memory_limit", lambda device: need - 1)
    with pytest.raises(ConfigError, match="checkpoint_device_snapshot"):
        loop._check_snapshot_room(step_fn, state, batch)


def test_the_room_check_compiles_the_step_the_first_call_runs(monkeypatch, caplog):
    """``_check_snapshot_room`` compiles the donating step ahead; the first call reuses it
    (compiling twice would double the run's compile time)."""
    monkeypatch.setattr(loop, "_memory_limit", lambda device: 10**12)
    step_fn, state, batch = _donating_train_step()
    loop._check_snapshot_room(step_fn, state, batch)
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        step_fn(state, batch)
    assert not [r for r in caplog.records if "room_step" in r.getMessage()]


def test_several_processes_are_refused(small_model, make_train, tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match="runs on one process only"):
        _run(small_model, make_train, tmp_path, "multi", steps=2, checkpoint_device_snapshot=True)
