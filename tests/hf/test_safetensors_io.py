"""safetensors directories: sharded writing, region reads, FP8 reads and dequantization."""

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

from dropless.hf.load import dequantize
from dropless.hf.safetensors_io import INDEX, TensorDir, TensorDirError, write_sharded


def _arrays(rng):
    return {
        "a.weight": rng.standard_normal((7, 5)).astype(np.float32),
        "b.weight": rng.standard_normal((3, 4, 6)).astype(ml_dtypes.bfloat16),
        "c.bias": rng.standard_normal((9,)).astype(np.float32),
    }


def test_sharded_write_and_region_reads(rng, tmp_path):
    arrays = _arrays(rng)
    index = write_sharded(iter(arrays.items()), str(tmp_path), max_shard_bytes=200)  # 140 | 144 + 36 bytes
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2 and all(os.path.exists(tmp_path / f) for f in files)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in arrays.values())
    tdir = TensorDir(str(tmp_path))
    assert tdir.names == set(arrays)
    for name, a in arrays.items():
        assert tdir.shape(name) == a.shape
        np.testing.assert_array_equal(tdir.read(name), a)
    region = (slice(1, 3), slice(None), slice(2, 5))
    got = tdir.read("b.weight", region)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got, arrays["b.weight"][region])


def _write_raw(path, tensors: dict[str, tuple[str, np.ndarray]]):
    """A safetensors file written by hand (safetensors' numpy writer has no float8)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, a) in tensors.items():
        data = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_fp8_region_dequantizes_like_the_blockwise_definition(rng, tmp_path):
    """W[i, j] = float32(code[i, j]) * scale_inv[i // bo, j // bi], checked element by
    element on a 10 x 7 weight in 4 x 3 blocks (partial blocks on both edges)."""
    block = (4, 3)
    codes = rng.standard_normal((10, 7)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2, (3, 3)).astype(np.float32)
    _write_raw(tmp_path / "model.safetensors",
               {"w": ("F8_E4M3", codes), "w_scale_inv": ("F32", scale)})
    tdir = TensorDir(str(tmp_path))
    assert tdir.dtype("w") == "F8_E4M3"
    rows, cols = slice(3, 9), slice(2, 7)
    got = dequantize(tdir.read("w", (rows, cols)), tdir.read("w_scale_inv"), rows, cols, block)
    for i in range(rows.start, rows.stop):
        for j in range(cols.start, cols.stop):
            want = np.float32(codes[i, j].astype(np.float32)) * scale[i // 4, j // 3]
            assert got[i - rows.start, j - cols.start] == want


def test_index_naming_a_missing_file_is_an_error(rng, tmp_path):
    write_sharded(iter(_arrays(rng).items()), str(tmp_path), max_shard_bytes=150)
    index = json.load(open(tmp_path / INDEX))
    index["weight_map"]["a.weight"] = "model-00009-of-00009.safetensors"
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(TensorDirError, match="model-00009-of-00009"):
        TensorDir(str(tmp_path))


def test_a_name_written_twice_is_an_error(tmp_path):
    a = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="x written twice"):
        write_sharded(iter([("x", a), ("x", a)]), str(tmp_path))
