"""The pinned host memory warm-up (``train.host_pool``) on CPU.

CPU devices have ``pinned_host`` and ``unpinned_host`` memories, so the warm-up's
thread runs here for real when a test admits the cpu backend (``BACKENDS``);
what it cannot show is the GPU pool's timing, which the GPU run measures.
The shard bookkeeping over several devices is in
``tests/parallel/multidevice/test_host_pool_shards.py``.
"""

import dataclasses
import io
import re
import threading
import types

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from rich.console import Console

from dropless.config.sections import MeshConfig
from dropless.train import host_pool
from dropless.train import loop as loop_lib
from dropless.train import metrics as metrics_lib


@pytest.fixture
def on_cpu(monkeypatch):
    """Admit the cpu backend, as if Orbax copied through pinned host memory there."""
    monkeypatch.setattr(host_pool, "BACKENDS", ("gpu", "cpu"))


def _state():
    mesh = jax.make_mesh((1,), ("x",))
    state = {"w": jax.ShapeDtypeStruct((64, 48), jax.numpy.bfloat16),
             "opt": [jax.ShapeDtypeStruct((64, 48), np.float32), jax.ShapeDtypeStruct((), np.int32)]}
    return state, jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), state)


def test_skipped_on_cpu_with_its_reason():
    assert jax.default_backend() == "cpu"
    assert host_pool.skip_reason(async_save=True) == (
        "the cpu backend: Orbax copies to pinned host memory only on GPU")
    assert host_pool.skip_reason(async_save=False) == "saves are synchronous (async_checkpointing=false)"


def test_skipped_without_the_memory_kind(on_cpu):
    assert host_pool.skip_reason(async_save=True) is None  # CPU devices have pinned_host
    assert host_pool.skip_reason(async_save=True, memory_kind="hbm_2") == "cpu has no hbm_2 memory"


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_warmup_allocates_every_copy_in_the_memory_kind(kind, monkeypatch):
    """Every shard of the state is put once, in ``kind``, on its device, from a
    thread other than the caller's; the result reports all of their bytes once."""
    puts, real_put = [], jax.device_put

    def spy(x, device=None, **kw):
        out = real_put(x, device, **kw)
        puts.append((x.shape, np.dtype(x.dtype), out.sharding.memory_kind, out.sharding.device_set,
                     threading.current_thread().name))
        return out

    monkeypatch.setattr(jax, "device_put", spy)
    state, shardings = _state()
    warm = host_pool.HostPoolWarmup(state, shardings, memory_kind=kind)
    assert warm.report() is None  # not started
    warm.start().wait()
    result = warm.report()
    assert result is not None and result.error is None and result.seconds > 0
    assert warm.report() is None  # reported once
    assert result.nbytes == 64 * 48 * 2 + 64 * 48 * 4 + 4
    device = {jax.devices()[0]}
    assert sorted(puts, key=str) == sorted(
        [((64, 48), np.dtype(jax.numpy.bfloat16), kind, device, "ckpt-host-warmup"),
         ((64, 48), np.dtype(np.float32), kind, device, "ckpt-host-warmup"),
         ((), np.dtype(np.int32), kind, device, "ckpt-host-warmup")], key=str)
    assert "warmed in" in result.line() and "0.00 GiB" in result.line()


def test_a_failed_warmup_is_one_line():
    state, shardings = _state()
    warm = host_pool.HostPoolWarmup(state, shardings, memory_kind="hbm_2").start()
    warm.wait()
    result = warm.report()
    assert result.error is not None and "\n" not in result.error
    assert result.line().startswith("checkpoint: pinned host memory warm-up failed after")
    assert "the first save allocates its own" in result.line()


def test_wait_blocks_until_the_warmup_ends(monkeypatch):
    """A save waits for a warm-up still running (the two together would need two
    pools), and then for nothing: ``wait`` returns 0.0 once it has ended."""
    release = threading.Event()
    monkeypatch.setattr(host_pool.HostPoolWarmup, "_allocate", lambda self: release.wait())
    state, shardings = _state()
    warm = host_pool.HostPoolWarmup(state, shardings).start()
    assert warm.report() is None  # still running
    threading.Timer(0.2, release.set).start()
    assert warm.wait() >= 0.1
    assert warm.report().error is None
    assert warm.wait() == 0.0


def _run(small_model, make_train, tmp_path, name, **keys):
    """14 steps, saves at 12 and 14, of the small model with one MoE layer: the warm-up
    starts after the first timed window (a short run prints, so times, every step)
    and before the first save."""
    console = Console(file=io.StringIO(), width=200)
    model = dataclasses.replace(small_model, num_decoder_layers=2)
    train = make_train(tmp_path, run_name=name, steps=14, checkpoint_period=12, enable_tensorboard=False,
                       **keys)
    result = loop_lib.run_training(model, train, MeshConfig(), console=console)
    return result, metrics_lib.read_jsonl(result.metrics_path), console.file.getvalue()


def test_training_is_unchanged_by_the_warmup(small_model, make_train, tmp_path, monkeypatch):
    """With the warm-up running in the loop (cpu admitted), every step's losses are
    bitwise those of the run without it; its line and row fields are there, and
    the saves' held times are recorded (the first on the result)."""
    off, rows_off, _ = _run(small_model, make_train, tmp_path, "off")
    monkeypatch.setattr(host_pool, "BACKENDS", ("gpu", "cpu"))
    on, rows_on, text = _run(small_model, make_train, tmp_path, "on", checkpoint_warm_host_memory=True)
    for key in ("loss", "lm_loss", "grad_norm"):
        assert [r[key] for r in rows_on] == [r[key] for r in rows_off], key
    assert [r["step"] for r in rows_on] == list(range(1, 15))  # the quiet steps' rows too, in order
    assert "checkpoint: pinning 0.00 GiB of host memory for the first save" in text
    assert re.search(r"; steps? \d+(-\d+)? run from batches put on the device beforehand \(in [\d.]+ s\)",
                     text)
    assert "checkpoint: pinned host memory warmed in" in text
    warmed = [r for r in rows_on if "checkpoint_warm_s" in r]
    # on the first row written after it ended: the window row before the quiet steps at the earliest
    assert len(warmed) == 1 and warmed[0]["step"] >= 2 and warmed[0]["checkpoint_warm_gib"] > 0
    assert on.checkpoint_saves == 2
    assert on.checkpoint_first_blocked_s is not None and on.checkpoint_first_blocked_s <= on.checkpoint_blocked_s


def test_the_loop_says_why_the_warmup_is_skipped(make_train, tmp_path):
    """On CPU, or without checkpoints, true gives one line and no thread; auto (the
    default) and false, no thread and nothing said."""
    console = Console(file=io.StringIO(), width=200)
    on = make_train(tmp_path, checkpoint_warm_host_memory=True)
    assert loop_lib._plan_warmup(None, on, object(), console) is None
    assert loop_lib._plan_warmup(None, on, None, console) is None
    assert make_train(tmp_path).checkpoint_warm_host_memory == "auto"
    for key in ("auto", False):
        train = make_train(tmp_path, checkpoint_warm_host_memory=key)
        assert loop_lib._plan_warmup(None, train, object(), console) is None
        assert loop_lib._plan_warmup(None, train, None, console) is None
    assert console.file.getvalue().splitlines() == [
        "checkpoint_warm_host_memory: skipped: the cpu backend: Orbax copies to pinned host memory only on GPU",
        "checkpoint_warm_host_memory: skipped: checkpointing is off",
    ]


def test_auto_plans_the_warmup_where_it_helps(make_train, tmp_path, monkeypatch):
    """auto (the default) plans a warm-up wherever true would, saying nothing extra;
    with async saves off it stays off, silently."""
    monkeypatch.setattr(host_pool, "BACKENDS", ("gpu", "cpu"))
    console = Console(file=io.StringIO(), width=200)
    s = types.SimpleNamespace(abstract={}, shardings={})
    for key in ("auto", True):
        warm = loop_lib._plan_warmup(s, make_train(tmp_path, checkpoint_warm_host_memory=key), object(), console)
        assert isinstance(warm, host_pool.HostPoolWarmup), key
    sync = make_train(tmp_path, async_checkpointing=False)
    assert loop_lib._plan_warmup(s, sync, object(), console) is None
    assert console.file.getvalue() == ""
