"""Reading and writing directories of safetensors files, a region at a time.

A Hugging Face model directory holds ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> file).
``TensorDir`` knows every tensor's file, shape and dtype from the headers
alone and reads any rectangular region of one tensor through a memory map,
so a reader holds in memory only the region it asked for. Each read opens
and closes its file: a mapping never outlives the read, so pages of the file
do not pile up in the process's resident set over a long load.

Regions are read with safetensors' ``safe_open(..., framework="numpy")``.
Its numpy path has no float8 types, so FP8 tensors (``F8_E4M3``, DeepSeek-V3's
weights) are read through ``numpy.memmap`` at the offsets of the file's
header, as ``ml_dtypes.float8_e4m3fn``; the file format is the same.

``write_sharded`` writes tensors as they come into shards of at most
``max_shard_bytes`` plus the index, the layout transformers reads.
"""

import json
import os
import struct
from typing import Iterable

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


class TensorDirError(ValueError):
    """A model directory whose files or index are missing or inconsistent."""


def _header(path: str) -> tuple[dict, int]:
    """(header dict, byte offset of the data section) of one safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def _normalize(index, shape) -> tuple[slice, ...]:
    """Full-rank tuple of step-1 slices with concrete bounds."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"only step-1 slices are read, got {s}")
        out.append(slice(start, stop))
    return tuple(out)


class TensorDir:
    """The tensors of a Hugging Face model directory, read region by region.

    ``names``: every tensor name. Names, shapes, dtypes and offsets are the
    headers' when the directory was opened; open it again after its files change.

    Raises (on construction):
      TensorDirError: no safetensors files, an index naming a missing file, or
        a tensor the index places in a file that does not hold it.
    """

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise TensorDirError(f"{index} has no weight_map")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            weight_map = None
            if not files:
                raise TensorDirError(f"{path} holds no *.safetensors files")
        self._file: dict[str, str] = {}
        self._info: dict[str, tuple[tuple[int, ...], str]] = {}
        self._offset: dict[str, int] = {}  # byte offset of each tensor's data in its file
        for name in files:
            full = os.path.join(path, name)
            if not os.path.exists(full):
                raise TensorDirError(f"{INDEX} names {name}, which is not in {path}")
            header, data_start = _header(full)
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                if weight_map is not None and weight_map.get(key) != name:
                    continue  # the index decides where a tensor is
                if key in self._file:
                    raise TensorDirError(f"tensor {key} is in both {self._file[key]} and {name}")
                self._file[key] = name
                self._info[key] = (tuple(meta["shape"]), meta["dtype"])
                self._offset[key] = data_start + meta["data_offsets"][0]
        if weight_map is not None:
            lost = sorted(set(weight_map) - set(self._file))
            if lost:
                raise TensorDirError(f"{INDEX} places {lost[0]} in {weight_map[lost[0]]}, which does not hold it")
        self.names = frozenset(self._file)  # like every field here, from the headers as read now

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name][0]

    def dtype(self, name: str) -> str:
        """The safetensors dtype string: ``BF16``, ``F32``, ``F8_E4M3`` ..."""
        return self._info[name][1]

    def read(self, name: str, index=()) -> np.ndarray:
        """The region ``index`` (a tuple of step-1 slices, missing axes whole) of ``name``.

        Returns a NumPy array in the file's dtype (bf16 and float8 as
        ``ml_dtypes`` types) holding only that region.
        """
        shape, dtype = self._info[name]
        region = _normalize(index, shape)
        full = os.path.join(self.path, self._file[name])
        if dtype in _RAW_DTYPES:
            return self._read_raw(full, self._offset[name], shape, region, _RAW_DTYPES[dtype])
        with safe_open(full, framework="numpy") as f:
            if not shape:
                return np.asarray(f.get_tensor(name))
            return np.ascontiguousarray(f.get_slice(name)[region])

    @staticmethod
    def _read_raw(full: str, offset: int, shape: tuple, region, dtype) -> np.ndarray:
        """One-byte tensors (FP8) from the file's bytes at ``offset``, found when the header
        was read once in ``__init__``."""
        mm = np.memmap(full, dtype=np.uint8, mode="r", offset=offset, shape=(int(np.prod(shape)),))
        try:
            return np.array(mm.reshape(shape)[region]).view(dtype)
        finally:
            del mm


def write_sharded(tensors: Iterable[tuple[str, np.ndarray]], out: str, *,
                  max_shard_bytes: int = 5 * 2**30) -> dict:
    """Write ``(name, array)`` pairs as shards ``model-0000i-of-0000N.safetensors`` + index.

    Shards fill in the order given; a tensor larger than ``max_shard_bytes``
    gets a shard of its own. At most one shard's tensors are held at a time.
    Metadata ``{"format": "pt"}`` as transformers writes it.

    Returns:
      the index dict (also written to ``out/model.safetensors.index.json``).

    Raises:
      ValueError: a name given twice.
    """
    os.makedirs(out, exist_ok=True)
    pending: dict[str, np.ndarray] = {}
    pending_bytes, parts, weight_map, total = 0, [], {}, 0

    def flush():
        nonlocal pending, pending_bytes
        if pending:
            tmp = f"part-{len(parts):05d}.safetensors.tmp"
            save_file(pending, os.path.join(out, tmp), metadata={"format": "pt"})
            parts.append((tmp, list(pending)))
            pending, pending_bytes = {}, 0

    for name, array in tensors:
        if name in weight_map or name in pending:
            raise ValueError(f"tensor {name} written twice")
        array = np.ascontiguousarray(array)
        if pending and pending_bytes + array.nbytes > max_shard_bytes:
            flush()
        pending[name] = array
        pending_bytes += array.nbytes
        total += array.nbytes
        weight_map[name] = None
    flush()
    for i, (tmp, names) in enumerate(parts):
        final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(os.path.join(out, tmp), os.path.join(out, final))
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out, INDEX), "w") as f:
        json.dump(index, f, indent=1)
    return index
