"""Data sources: the Markov entropy is right, batches are a pure function of
(seed, step), text is packed faithfully, and bad inputs fail with clear errors.
"""

import json
import math

import numpy as np
import pytest

from dropless.config.sections import DataConfig
from dropless.train import data as data_lib


def test_markov_entropy_matches_the_empirical_log_loss():
    src = data_lib.MarkovSource(64, 1, 0.2, seed=5, batch=256, seq=128)
    b = src.batch_at(0)
    assert b.inputs.shape == (1, 256, 128) and b.inputs.dtype == np.int32
    np.testing.assert_array_equal(b.inputs[..., 1:], b.targets[..., :-1])
    # The true model's log loss on a fresh sample estimates the entropy rate.
    nll = -np.log(src.prob(b.inputs, b.targets))
    stderr = nll.std() / math.sqrt(nll.size) * 3  # tokens are correlated: generous band
    assert abs(nll.mean() - src.entropy_floor) < max(6 * stderr, 0.02)
    assert 0 < src.entropy_floor < math.log(64)


def test_markov_higher_order_entropy():
    src = data_lib.MarkovSource(8, 2, 0.3, seed=1, batch=512, seq=256)
    b = src.batch_at(0)
    state = b.inputs[..., :-1] * 8 + b.inputs[..., 1:]  # (t_{-1}, t_0) as s = t_{-1} V + t_0
    nll = -np.log(src.prob(state, b.targets[..., 1:]))
    assert abs(nll.mean() - src.entropy_floor) < 0.02


def test_sparse_markov_entropy_and_successors():
    """M=8 successors of V=3000: every target is a successor, and the true model's
    log loss estimates the entropy rate (same band as the dense test)."""
    src = data_lib.MarkovSource(3000, 1, 0.5, seed=2, batch=256, seq=128, successors=8)
    assert src.successors.shape == src.probs.shape == (3000, 8)
    assert np.all(np.diff(src.successors, axis=1) > 0) and src.successors.max() < 3000
    np.testing.assert_allclose(src.probs.sum(axis=1), 1.0, rtol=1e-12)
    b = src.batch_at(0)
    p = src.prob(b.inputs, b.targets)
    assert np.all(p > 0)  # no token outside its state's successors
    nll = -np.log(p)
    stderr = nll.std() / math.sqrt(nll.size) * 3
    assert abs(nll.mean() - src.entropy_floor) < max(6 * stderr, 0.02)
    assert src.entropy_floor < math.log(8)  # at most uniform over the 8 successors
    assert "8 successors per state" in src.description


def test_markov_default_fits_any_vocabulary():
    """The DeepSeek-V3 vocabulary: the default table is [V, 64], not [V, V] (16.7G entries)."""
    src = data_lib.make_source(DataConfig(dataset_type="markov"), 129_280, batch=1, seq=8)
    assert src.successors.shape == (129_280, DataConfig().markov_successors) == (129_280, 64)
    assert src.batch_at(0).inputs.max() < 129_280


def test_stationary_distribution_of_a_known_chain():
    p = np.array([[0.9, 0.1], [0.5, 0.5]])
    np.testing.assert_allclose(data_lib.stationary_distribution(p), [5 / 6, 1 / 6], rtol=1e-10)


@pytest.mark.parametrize("kind", ["synthetic", "markov"])
def test_batches_are_a_pure_function_of_seed_and_step(kind):
    def make(seed):
        return data_lib.make_source(DataConfig(dataset_type=kind, data_seed=seed), 50,
                                    batch=4, seq=8, accum=2)

    a, b = make(0), make(0)
    for step in (7, 0, 3):  # any order: no iterator state
        np.testing.assert_array_equal(a.batch_at(step).inputs, b.batch_at(step).inputs)
    assert a.batch_at(0).inputs.shape == (2, 4, 8)
    assert not np.array_equal(a.batch_at(0).inputs, a.batch_at(1).inputs)
    assert not np.array_equal(a.batch_at(0).inputs, make(1).batch_at(0).inputs)
    if kind == "synthetic":
        assert a.entropy_floor == pytest.approx(math.log(50))


def test_text_bytes_windows_and_epochs(tmp_path):
    letters = np.random.default_rng(0).integers(ord("a"), ord("z") + 1, 200).astype(np.uint8)
    first = letters.tobytes().decode()
    (tmp_path / "a.txt").write_text(first)
    with open(tmp_path / "b.jsonl", "w") as f:
        f.write(json.dumps({"text": "second document"}) + "\n\n")
        f.write(json.dumps({"text": "third"}) + "\n")
    cfg = DataConfig(dataset_type="text", dataset_path=str(tmp_path), data_seed=2)
    src = data_lib.make_source(cfg, 256, batch=3, seq=10)
    text = first.encode() + b"\0" + b"second document\0third\0"
    np.testing.assert_array_equal(src.tokens, np.frombuffer(text, np.uint8))
    assert src.entropy_floor is None and src.num_windows == (len(text) - 1) // 10
    windows = {bytes(src.tokens[i * 10:i * 10 + 10].astype(np.uint8)): i for i in range(src.num_windows)}
    assert len(windows) == src.num_windows  # random letters: every window is distinct
    seen = []
    for step in range(src.num_windows // 3 + 2):  # runs into the second epoch
        b = src.batch_at(step)
        for row_in, row_t in zip(b.inputs[0], b.targets[0]):
            w = windows[bytes(row_in.astype(np.uint8))]
            np.testing.assert_array_equal(row_t, src.tokens[w * 10 + 1:w * 10 + 11])
            seen.append(w)
    # Each epoch visits every window exactly once, in a seeded order.
    assert sorted(seen[: src.num_windows]) == list(range(src.num_windows))
    assert seen[: src.num_windows] != list(range(src.num_windows))


def test_token_file_is_memory_mapped_and_read_by_window(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 1000, 501).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", tokens)
    cfg = DataConfig(dataset_type="text", dataset_path=str(tmp_path / "tokens.npy"), data_seed=2)
    src = data_lib.make_source(cfg, 1000, batch=4, seq=10, accum=2)
    assert isinstance(src.tokens, np.memmap) and src.num_windows == 50
    b = src.batch_at(3)
    assert b.inputs.dtype == np.int32
    for row_in, row_t in zip(b.inputs.reshape(-1, 10), b.targets.reshape(-1, 10)):
        w = int(np.flatnonzero((tokens[:-1].reshape(-1, 10)[:50] == row_in).all(axis=1))[0])
        np.testing.assert_array_equal(row_t, tokens[w * 10 + 1:w * 10 + 11])
    np.testing.assert_array_equal(src.batch_at(3, [1, 3]).inputs, b.inputs[:, [1, 3]])
    with pytest.raises(ValueError, match=r"outside \[0, vocab_size=500\)"):
        for step in range(13):  # one epoch: every window is read once
            data_lib.make_source(cfg, 500, batch=4, seq=10).batch_at(step)


def test_token_file_errors(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((4, 4), np.int32))
    with pytest.raises(ValueError, match=r"1-D integer array, got shape \(4, 4\)"):
        _text(tmp_path, dataset_path=str(tmp_path / "a.npy"))
    np.save(tmp_path / "f.npy", np.zeros(40, np.float32))
    with pytest.raises(ValueError, match="1-D integer array, got shape .* of float32"):
        _text(tmp_path, dataset_path=str(tmp_path / "f.npy"))
    with pytest.raises(ValueError, match="must be the only file; it matches 2"):
        _text(tmp_path, dataset_path=str(tmp_path))
    np.save(tmp_path / "ok.npy", np.zeros(40, np.int32))
    with pytest.raises(ValueError, match="does not apply to"):
        _text(tmp_path, dataset_path=str(tmp_path / "ok.npy"), tokenizer_path="tok.json")


def _text(tmp_path, **kw):
    return data_lib.make_source(DataConfig(dataset_type="text", **kw), 256, batch=2, seq=8)


def test_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        _text(tmp_path, dataset_path=str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="needs dataset_path"):
        _text(tmp_path, dataset_path="")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="matches no files"):
        _text(tmp_path, dataset_path=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="matches no files"):
        _text(tmp_path, dataset_path=str(tmp_path / "*.txt"))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="is not one of"):
        _text(tmp_path, dataset_path=str(tmp_path / "data.csv"))
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(ValueError, match="fewer than one window"):
        _text(tmp_path, dataset_path=str(tmp_path / "short.txt"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        _text(tmp_path, dataset_path=str(tmp_path / "bad.jsonl"))
    (tmp_path / "nofield.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match=r"nofield.jsonl:1: expected an object with a string 'text'"):
        _text(tmp_path, dataset_path=str(tmp_path / "nofield.jsonl"))
    (tmp_path / "ok.txt").write_text("long enough text " * 10)
    with pytest.raises(FileNotFoundError, match="tokenizer_path"):
        _text(tmp_path, dataset_path=str(tmp_path / "ok.txt"), tokenizer_path=str(tmp_path / "tok.json"))
    with pytest.raises(ValueError, match="vocab_size=100"):
        data_lib.make_source(DataConfig(dataset_type="text", dataset_path=str(tmp_path / "ok.txt")),
                             100, batch=2, seq=8)


def test_config_errors():
    with pytest.raises(ValueError, match="dataset_type='grain'"):
        data_lib.make_source(DataConfig(dataset_type="grain"), 16, batch=1, seq=4)
    with pytest.raises(ValueError, match="markov_order=0"):
        data_lib.make_source(DataConfig(markov_order=0), 16, batch=1, seq=4)
    with pytest.raises(ValueError, match="lower markov_order or markov_successors"):
        data_lib.make_source(DataConfig(markov_order=3), 1024, batch=1, seq=4)


def test_global_batch_size_is_whole_and_splits_over_the_shards():
    from dropless.train.data import global_batch_size

    assert global_batch_size(2, 4, 1) == 8 and global_batch_size(0.5, 4, 2) == 2
    with pytest.raises(ValueError, match=r"per_device_batch_size=0.5 x 3 devices = 1.5 is not a whole"):
        global_batch_size(0.5, 3, 1)
    with pytest.raises(ValueError, match="global batch 4 does not split over the 3 batch shards"):
        global_batch_size(2, 2, 3)
