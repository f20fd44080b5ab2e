"""Each process makes only its rows of the batch, and they assemble to the whole batch.

On 8 CPU devices, for every dataset type (text also as a .npy token file) and meshes that split the batch over
data, fsdp and expert (and replicate it over tensor): the global array
``BatchFeed`` assembles equals ``batch_at(step)`` of the source, every device
holds its slice, and simulated processes (groups of devices) each make only
their own sequences, bit-identical to the whole batch's and covering it.
"""

import numpy as np
import pytest
from conftest import make_mesh

from dropless.config.sections import DataConfig
from dropless.parallel import mesh as mesh_lib
from dropless.train import data as data_lib
from dropless.train.loop import BatchFeed

ACCUM, BATCH, SEQ = 2, 16, 8
MESHES = [dict(data=2, fsdp=2, expert=2), dict(fsdp=4, expert=2), dict(expert=8),
          dict(data=2, expert=2, tensor=2)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    text = tmp_path_factory.mktemp("text") / "corpus.txt"
    letters = np.random.default_rng(0).integers(ord("a"), ord("z") + 1, 3000).astype(np.uint8)
    text.write_bytes(letters.tobytes())
    np.save(text.with_suffix(".npy"), letters.astype(np.int32) - ord("a"))
    cfgs = {"synthetic": DataConfig(dataset_type="synthetic", data_seed=4),
            "markov": DataConfig(dataset_type="markov", markov_order=2, data_seed=4),
            "text": DataConfig(dataset_type="text", dataset_path=str(text), data_seed=4),
            "tokens": DataConfig(dataset_type="text", dataset_path=str(text.with_suffix(".npy")),
                                 data_seed=4)}
    vocab = {"synthetic": 16, "markov": 16, "text": 256, "tokens": 26}
    return {k: data_lib.make_source(c, vocab[k], batch=BATCH, seq=SEQ, accum=ACCUM)
            for k, c in cfgs.items()}


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()))
@pytest.mark.parametrize("kind", ["synthetic", "markov", "text", "tokens"])
def test_assembled_batch_is_the_global_batch(sources, kind, axes):
    source = sources[kind]
    mesh = make_mesh(**axes)
    feed = BatchFeed(source, mesh)
    for step in (0, 3, 37):  # 37: text wraps into its second epoch
        whole = source.batch_at(step)
        got = feed(step)
        for name in whole._fields:
            array, want = getattr(got, name), getattr(whole, name)
            assert array.shape == want.shape and array.sharding == feed.sharding
            np.testing.assert_array_equal(np.asarray(array), want)
            for shard in array.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def _hosts(mesh, per_host):
    """Devices grouped as processes would own them: consecutive blocks of the mesh's device order."""
    flat = list(mesh.devices.flat)
    return [flat[i:i + per_host] for i in range(0, len(flat), per_host)]


@pytest.mark.parametrize("axes", MESHES[:3], ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()))
@pytest.mark.parametrize("kind", ["synthetic", "markov", "text"])
def test_simulated_processes_make_only_their_rows(sources, kind, axes):
    source = sources[kind]
    mesh = make_mesh(**axes)
    sharding = mesh_lib.batch_sharding(mesh, leading_dims=1)
    shape = (ACCUM, BATCH, SEQ)
    whole = source.batch_at(5)
    for per_host in (2, 4):
        held = [mesh_lib.held_indices(sharding, shape, 1, devices=h) for h in _hosts(mesh, per_host)]
        # The batch axes split all 8 devices: hosts hold disjoint sequences covering the batch.
        assert sorted(np.concatenate(held).tolist()) == list(range(BATCH))
        for seqs in held:
            assert len(seqs) == BATCH * per_host // 8
            part = source.batch_at(5, seqs)
            np.testing.assert_array_equal(part.inputs, whole.inputs[:, seqs])
            np.testing.assert_array_equal(part.targets, whole.targets[:, seqs])


def test_rows_requested_are_exactly_the_held_ones(sources):
    source = sources["markov"]
    mesh = make_mesh(data=2, expert=2, tensor=2)
    sharding = mesh_lib.batch_sharding(mesh, leading_dims=1)
    # A host owning the devices at expert index 1 (any data, tensor) holds
    # non-contiguous sequence blocks [4, 8) and [12, 16).
    devices = list(mesh.devices[:, 0, 1, :].flat)
    seqs = mesh_lib.held_indices(sharding, (ACCUM, BATCH, SEQ), 1, devices=devices)
    assert seqs.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    asked = []
    original = source.rows_at
    source.rows_at = lambda step, rows: asked.append(rows.tolist()) or original(step, rows)
    try:
        source.batch_at(2, seqs)
    finally:
        del source.rows_at
    assert asked == [[a * BATCH + s for a in range(ACCUM) for s in seqs]]


def test_bad_sequence_indices_are_refused(sources):
    source = sources["synthetic"]
    for seqs in ([3, 1], [0, BATCH], [-1, 2], [], [[0, 1]], [0.0, 1.0]):
        with pytest.raises(ValueError, match=rf"strictly increasing sequence indices in \[0, {BATCH}\)"):
            source.batch_at(0, seqs)
