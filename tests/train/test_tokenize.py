"""``dropless tokenize``: the .npy it writes trains on exactly the text source's batches."""

import json
import os

import numpy as np
import pytest

from dropless import cli
from dropless.config.sections import DataConfig
from dropless.train import data as data_lib
from dropless.train import tokenize as tokenize_lib

DOCS = ["The quick brown fox.", "ünïcödé — and more", "", "jumps over the lazy dog " * 5]


def _corpus(tmp_path, rng):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    words = ["alpha", "beta", "gamma", "δέλτα", "ε", "\n"]
    (root / "a.txt").write_text(" ".join(rng.choice(words, 60)), encoding="utf-8")
    with open(root / "sub" / "b.jsonl", "w", encoding="utf-8") as f:
        for doc in DOCS + [" ".join(rng.choice(words, 40))]:
            f.write(json.dumps({"text": doc}) + "\n")
    return root


def _source(path, **kw):
    return data_lib.make_source(DataConfig(dataset_type="text", dataset_path=str(path), data_seed=3),
                                256, batch=4, seq=16, accum=2, **kw)


def test_npy_gives_the_text_sources_batches(tmp_path, rng):
    corpus = _corpus(tmp_path, rng)
    out = tmp_path / "tokens.npy"
    assert cli.main(["tokenize", str(corpus), "--out", str(out), "--vocab-size", "256"]) == 0
    tokens = np.load(out)
    assert tokens.dtype == np.uint16  # bytes fit
    text = _source(corpus)
    np.testing.assert_array_equal(tokens, text.tokens)  # the same stream, token for token
    # The stream by hand: every document's UTF-8 bytes, then the separator 0.
    docs = [(corpus / "a.txt").read_text(encoding="utf-8")]
    docs += [json.loads(line)["text"] for line in open(corpus / "sub" / "b.jsonl", encoding="utf-8")]
    by_hand = np.concatenate([np.frombuffer(d.encode() + b"\0", np.uint8) for d in docs])
    np.testing.assert_array_equal(tokens, by_hand)
    npy = _source(out)
    for step in (0, 1, 7):
        a, b = text.batch_at(step), npy.batch_at(step)
        np.testing.assert_array_equal(a.inputs, b.inputs)
        np.testing.assert_array_equal(a.targets, b.targets)
    record = json.loads((tmp_path / "tokens.npy.json").read_text())
    assert record["tokens"] == len(tokens) and record["documents"] == len(docs)
    assert record["tokenizer"] == "bytes" and len(record["files"]) == 2
    assert sorted(os.listdir(tmp_path)) == ["corpus", "tokens.npy", "tokens.npy.json"]


def test_existing_output_is_kept_without_force(tmp_path, rng, capsys):
    corpus = _corpus(tmp_path, rng)
    out = tmp_path / "tokens.npy"
    np.save(out, np.arange(5))
    assert cli.main(["tokenize", str(corpus), "--out", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    np.testing.assert_array_equal(np.load(out), np.arange(5))  # untouched
    assert cli.main(["tokenize", str(corpus), "--out", str(out), "--force"]) == 0
    assert len(np.load(out)) > 5


@pytest.mark.parametrize("problem, message", [
    ("missing", "no such file or directory"),
    ("bad_jsonl", "b.jsonl:2: not valid JSON"),
    ("vocab", "has 256 tokens but vocab_size=100"),
    ("npy_in", "is a .npy token file already"),
    ("suffix", "must end in .npy"),
])
def test_bad_input_exits_2_and_leaves_nothing(problem, message, tmp_path, rng, capsys):
    corpus = _corpus(tmp_path, rng)
    out, args = tmp_path / "out" / "tokens.npy", []
    out.parent.mkdir()
    if problem == "missing":
        corpus = tmp_path / "nope"
    elif problem == "bad_jsonl":
        (corpus / "sub" / "b.jsonl").write_text('{"text": "ok"}\n{broken\n')
    elif problem == "vocab":
        args = ["--vocab-size", "100"]
    elif problem == "npy_in":
        np.save(corpus / "x.npy", np.arange(3))
    elif problem == "suffix":
        out = out.with_suffix(".bin")
    assert cli.main(["tokenize", str(corpus), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert os.listdir(out.parent) == []  # no partial files
