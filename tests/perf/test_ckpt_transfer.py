"""benchmarks/ckpt_transfer.py: its CPU smoke run, the state it fills, and its pre-flight."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from dropless.perf.bench import load_module
from dropless.train.checkpoint import save_bytes

REPO = Path(__file__).parents[2]
probe = load_module("ckpt_transfer", REPO / "benchmarks")


def test_tiny_run_records_every_phase_and_removes_its_checkpoints(tmp_path):
    """Every phase runs on deepseek3-tiny and leaves a row; the loop's baselines saw every
    mode; Orbax's pinned handler copies pageably on CPU, and the row says so."""
    work = tmp_path / "ckpt"
    assert probe.main(["--tiny", "--out", str(tmp_path), "--dir", str(work)]) == 0
    (path,) = tmp_path.glob("ckpt_transfer-*.json")
    record = json.loads(path.read_text())
    assert record["kind"] == "ckpt_transfer" and record["partial"] is False
    abstract = probe.abstract_state("deepseek3-tiny", [])
    assert record["config"]["state_bytes"] == save_bytes(abstract)
    assert record["config"]["leaves"] == len(jax.tree.leaves(abstract))
    for summary in record["baseline"].values():
        assert all(summary[mode]["iters"] > 0 for mode in probe.MODES)
    cases = [(r["phase"], r["case"]) for r in record["rows"]]
    assert cases == [
        ("host", "numpy, one thread"), ("snapshot", "best of 2 (reads and writes each byte)"),
        ("device_get", "alone"), ("device_get", "beside the loop"),
        ("pinned", "cold, beside the loop"), ("pinned", "warm, alone"),
        ("pinned_to_numpy", "the warm copy, device_get"), ("pinned", "warm, beside the loop"),
        ("orbax_pageable", "beside the loop"), ("orbax_pinned", "beside the loop")]
    *copies, pageable, pinned = record["rows"][1:]
    assert all(r["seconds"] > 0 for r in copies)
    assert all(set(r["loop"]["copy"]) == set(probe.MODES) for r in copies if "loop" in r)
    for r in (pageable, pinned):
        assert r["call_s"] > 0 and r["write_s"] > 0 and r["written_bytes"] > 0
        assert r["marks"]["start"] < r["marks"]["call_end"] < r["marks"]["end"]
    assert pinned["pinned_copies"] is False and pageable["pinned_copies"] is False
    assert list(work.iterdir()) == []


def _hash_reference(index_u32):
    """MurmurHash3's finaliser in NumPy (uint32 products wrap, as in the C original)."""
    x = index_u32.copy()
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = (x ^ (x >> np.uint32(shift))) * np.uint32(mul)
    return x ^ (x >> np.uint32(16))


def test_random_state_is_the_hash_of_each_index():
    """Leaf i, element j: hash(j + i * 0x9E3779B9 mod 2**32) >> 8 as a uniform on [-0.5, 0.5),
    times 0.02 sqrt(12) (std 0.02). Each step is one float32 operation (exact up to the two
    scalings), taken in the reference's order, so the values are equal; bfloat16 leaves are the
    same values rounded; integer leaves are zero."""
    abstract = {"a": jax.ShapeDtypeStruct((3, 5), jnp.float32),
                "b": jax.ShapeDtypeStruct((3, 5), jnp.bfloat16),
                "n": jax.ShapeDtypeStruct((2,), jnp.int32)}
    state = probe.random_state(abstract)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == \
        jax.tree.map(lambda x: (x.shape, x.dtype), abstract)
    scale = np.float32(0.02) * np.float32(np.sqrt(12.0))
    for i, name in enumerate(("a", "b")):
        bits = _hash_reference(np.arange(15, dtype=np.uint32) + np.uint32(i * 0x9E3779B9 % 2**32))
        unit = (bits >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24) - np.float32(0.5)
        want = (scale * unit).reshape(3, 5).astype(abstract[name].dtype)
        np.testing.assert_array_equal(np.asarray(state[name]), want)
    np.testing.assert_array_equal(state["n"], [0, 0])


def test_preflight_names_the_disk_and_the_way_out(tmp_path):
    problem = probe.preflight(["orbax_pageable"], 2**62, str(tmp_path / "missing"), on_cpu=False)
    assert f"free on the filesystem of {tmp_path}" in problem and "--dir" in problem
    assert probe.preflight(["device_get"], 1, str(tmp_path), on_cpu=True) is None
