"""Load a Hugging Face model directory into dropless's parameters, streaming.

``load_hf(path, model_cfg, abstract, shardings)`` returns ``{"params",
"router_bias"}`` as global ``jax.Array``s placed with ``shardings``:

1. Every check runs before anything is read: the tensor names against the
   architecture's mapping (``ARCHITECTURES[model_type].mapping``), each
   tensor's shape and dtype, FP8 scales, the MTP copies of the embedding and
   head. A missing, unexpected or wrong-shaped tensor is a one-line
   ``HFCheckpointError`` naming it; nothing is returned partially.
2. Each leaf is built shard by shard on the devices of this process: for
   each shard's index (``sharding.addressable_devices_indices_map``), one
   cell of its leading axes at a time (a layer, or a layer's expert) is read
   from just that region of the HF tensors behind it (``TensorDir.read``,
   memory-mapped), transposed to ``[in, out]``, dequantized if FP8, cast to
   the parameter dtype, copied to the device and written into the shard in
   place (a donated ``dynamic_update_slice``); the shards become one global
   array (``jax.make_array_from_single_device_arrays``). A process reads only
   what its devices hold, and the host holds one cell (at most one HF
   tensor's region) beyond what the devices hold.

FP8 E4M3 weights (DeepSeek-V3 as released) come with ``<name>_scale_inv``
``[ceil(out/bo), ceil(in/bi)]`` float32, one scale per ``(bo, bi)`` block
(config.json ``quantization_config.weight_block_size``, default 128 x 128);
the value is ``float32(code) * scale_inv`` of its block.
"""

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from dropless.config.hf_config import HFConfigError, read_config_json
from dropless.config.loader import ConfigError
from dropless.config.sections import ModelConfig
from dropless.hf import ARCHITECTURES
from dropless.hf.safetensors_io import TensorDir, TensorDirError

FLOAT_DTYPES = ("F32", "BF16", "F16")
FP8_DTYPES = ("F8_E4M3",)
SCALE_SUFFIX = "_scale_inv"
_ALIAS_ROWS = 4096  # rows per chunk when checking the MTP copies


class HFCheckpointError(ConfigError):
    """A Hugging Face directory that does not hold the model its config.json describes."""


def _architecture(hf: dict):
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HFCheckpointError(f"model_type={model_type!r} is not supported "
                                f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[model_type]


def _fp8_block(hf: dict) -> tuple[int, int]:
    block = (hf.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


def dequantize(codes: np.ndarray, scale_inv: np.ndarray, rows: slice, cols: slice,
               block: tuple[int, int]) -> np.ndarray:
    """float32 values of the FP8 region ``codes = W[rows, cols]`` of a blockwise-scaled W.

    Args:
      codes: [r, c] float8 codes (the region).
      scale_inv: [ceil(R/bo), ceil(C/bi)] float32 scales of the whole W.
      rows, cols: the region's place in W (step-1 slices with bounds).
      block: (bo, bi).
    """
    r_blocks = np.arange(rows.start, rows.stop) // block[0]
    c_blocks = np.arange(cols.start, cols.stop) // block[1]
    return codes.astype(np.float32) * scale_inv[np.ix_(r_blocks, c_blocks)]


class _Plan:
    """A checked directory: the mapping of its tensors onto the model's leaves."""

    def __init__(self, path: str, cfg: ModelConfig):
        try:
            hf = read_config_json(path)
            self.tdir = TensorDir(path)
        except (HFConfigError, TensorDirError) as e:
            raise HFCheckpointError(str(e)) from None
        arch = _architecture(hf)
        self.block = _fp8_block(hf)
        try:
            layout = arch.detect_layout(self.tdir.names)
        except ValueError as e:
            raise HFCheckpointError(f"{path}: {e}") from None
        hf_mtp = int(hf.get("num_nextn_predict_layers") or 0)
        if cfg.mtp_num_layers > hf_mtp:
            raise HFCheckpointError(f"mtp_num_layers={cfg.mtp_num_layers} but {path} has "
                                    f"num_nextn_predict_layers={hf_mtp}")
        self.mapping = arch.mapping(cfg, layout, hf_mtp)
        self.path, self.layout = path, layout
        self._check()

    def _expected(self) -> dict[str, tuple[int, ...]]:
        out = {}
        for leaf in self.mapping.leaves:
            for cell in leaf.grid.flat:
                for part in cell:
                    out[part.name] = part.hf_shape
        return out

    def _check(self) -> None:
        tdir, where = self.tdir, self.path
        expected = self._expected()
        for name, shape in sorted(expected.items()) + sorted(
                (a, expected[t]) for a, t in self.mapping.aliases.items()):
            if name not in tdir.names:
                hint = " (set mtp_num_layers=0 to load without the MTP layers)" if name in \
                    self.mapping.aliases or self._is_mtp(name) else ""
                raise HFCheckpointError(f"{where} is missing tensor {name} {list(shape)}{hint}")
            if tdir.shape(name) != shape:
                raise HFCheckpointError(f"{where}: tensor {name} has shape {list(tdir.shape(name))}, "
                                        f"expected {list(shape)}")
            self._check_dtype(name)
        scales = {n + SCALE_SUFFIX for n in expected if tdir.dtype(n) in FP8_DTYPES}
        known = set(expected) | set(self.mapping.aliases) | scales
        unexpected = sorted(n for n in tdir.names - known
                            if not n.startswith(self.mapping.skipped_prefixes or ("\0",)))
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise HFCheckpointError(f"{where} has unexpected tensor {unexpected[0]} "
                                    f"{list(tdir.shape(unexpected[0]))}{more}")
        for alias, target in sorted(self.mapping.aliases.items()):
            self._check_alias(alias, target)

    def _is_mtp(self, name: str) -> bool:
        return any(name.startswith(p) for p in {a.rsplit(".", 2)[0] for a in self.mapping.aliases})

    def _check_dtype(self, name: str) -> None:
        tdir, dtype = self.tdir, self.tdir.dtype(name)
        if dtype in FLOAT_DTYPES:
            return
        if dtype not in FP8_DTYPES:
            raise HFCheckpointError(f"{self.path}: tensor {name} has dtype {dtype}, expected one of "
                                    f"{FLOAT_DTYPES + FP8_DTYPES}")
        shape = tdir.shape(name)
        if len(shape) != 2:
            raise HFCheckpointError(f"{self.path}: FP8 tensor {name} is {len(shape)}-D; only 2-D "
                                    "weights with block scales are supported")
        scale = name + SCALE_SUFFIX
        want = (math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1]))
        if scale not in tdir.names:
            raise HFCheckpointError(f"{self.path} is missing tensor {scale} {list(want)} (scales of FP8 {name})")
        if tdir.shape(scale) != want:
            raise HFCheckpointError(f"{self.path}: tensor {scale} has shape {list(tdir.shape(scale))}, "
                                    f"expected {list(want)} for {self.block[0]}x{self.block[1]} blocks")

    def _check_alias(self, alias: str, target: str) -> None:
        """The MTP layer's copy must equal the main tensor (dropless shares one)."""
        rows = self.tdir.shape(target)[0]
        for lo in range(0, rows, _ALIAS_ROWS):
            region = (slice(lo, min(rows, lo + _ALIAS_ROWS)),)
            if not np.array_equal(self.read(alias, region), self.read(target, region)):
                raise HFCheckpointError(f"{self.path}: tensor {alias} differs from {target}; dropless's "
                                        "MTP shares the main model's embedding and head")

    def read(self, name: str, region) -> np.ndarray:
        """float32 values of ``name[region]`` (FP8 dequantized)."""
        x = self.tdir.read(name, region)
        if self.tdir.dtype(name) in FP8_DTYPES:
            full = self.tdir.shape(name)
            rows, cols = (slice(*s.indices(n)[:2]) for s, n in zip(
                tuple(region) + (slice(None),) * (2 - len(region)), full))
            x = dequantize(x, self.tdir.read(name + SCALE_SUFFIX), rows, cols, self.block)
        return x.astype(np.float32, copy=False)


def _span(s: slice, n: int) -> slice:
    start, stop, _ = s.indices(n)
    return slice(start, stop)


def _read_cell(plan: _Plan, leaf, cell, body: tuple[slice, ...]) -> np.ndarray:
    """float32 ``cell``'s values over the body region ``body`` (zeros for an empty cell)."""
    if not cell:
        return np.zeros(tuple(s.stop - s.start for s in body), np.float32)
    if not leaf.transpose:
        return plan.read(cell[0].name, body)
    lo, hi = body[-1].start, body[-1].stop
    pieces, offset = [], 0
    for part in cell:
        a, b = max(lo, offset), min(hi, offset + part.length)
        if a < b:
            base = part.rows[0] if part.rows else 0
            rows = slice(base + a - offset, base + b - offset)
            pieces.append(np.swapaxes(plan.read(part.name, (*body[:-2], rows, body[-2])), -1, -2))
        offset += part.length
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=-1)


def _body_region(leaf, index) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """(lead slices, body slices) of a shard index, with concrete bounds."""
    region = tuple(_span(s, n) for s, n in zip(tuple(index) + (slice(None),) * len(leaf.shape), leaf.shape))
    return region[: leaf.lead], region[leaf.lead:]


@functools.partial(jax.jit, donate_argnums=0)
def _put_cell(buf, piece, pos):
    """``buf[pos] = piece`` in place (``pos`` indexes buf's leading axes)."""
    start = (*pos, *([0] * piece.ndim))
    return jax.lax.dynamic_update_slice(buf, piece.reshape((1,) * len(pos) + piece.shape), start)


def _build_leaf(plan: _Plan, leaf, sharding, dtype) -> jax.Array:
    """The global array of ``leaf``, one lead cell at a time into each local shard.

    Devices that hold the same region share each host read. A leaf without
    leading axes is read as its shard region at once.
    """
    groups: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
        lead, body = _body_region(leaf, index)
        groups.setdefault((lead, body), []).append(device)
    shards = {}
    for (lead, body), devices in groups.items():
        sizes = [s.stop - s.start for s in lead + body]
        if not lead:
            piece = _read_cell(plan, leaf, leaf.grid[()], body).astype(dtype)
            for device in devices:
                shards[device] = jax.device_put(piece, device)
            continue
        bufs = {d: jnp.zeros(sizes, dtype, device=d) for d in devices}
        for pos in np.ndindex(*sizes[: len(lead)]):
            cell = leaf.grid[tuple(s.start + p for s, p in zip(lead, pos))]
            piece = _read_cell(plan, leaf, cell, body).astype(dtype)
            at = tuple(np.int32(p) for p in pos)
            for device in devices:
                bufs[device] = _put_cell(bufs[device], jax.device_put(piece, device), at)
        shards.update(bufs)
    arrays = [shards[d] for d in sharding.addressable_devices_indices_map(leaf.shape)]
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)


def _paths(tree) -> dict[tuple, object]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(getattr(k, "key", getattr(k, "idx", None)) for k in p): x for p, x in flat}


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _plan(path: str, cfg: ModelConfig) -> _Plan:
    """The checked plan of ``path`` for ``cfg``: the trainer checks the directory at start
    and loads it later in the same process; both use one plan (headers read, names
    mapped and checked once) unless a file in the directory changed in between."""
    return _cached_plan(path, cfg, _stamp(path))


def _stamp(path: str) -> tuple:
    """(name, size, mtime) of every file in ``path``: what a cached plan was made from."""
    try:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                            for e in os.scandir(path) if e.is_file()))
    except OSError:
        return ()  # _Plan names the problem


@functools.lru_cache(maxsize=1)
def _cached_plan(path: str, cfg: ModelConfig, stamp: tuple) -> _Plan:
    del stamp  # part of the cache key only
    return _Plan(path, cfg)


def check(path: str, cfg: ModelConfig) -> str:
    """Run every check of ``load_hf`` without loading; returns the layout found.

    Raises:
      HFCheckpointError: as ``load_hf``.
    """
    return _plan(path, cfg).layout


def load_hf(path: str, cfg: ModelConfig, abstract: dict, shardings: dict) -> dict:
    """``{"params", "router_bias"}`` from the Hugging Face directory ``path``.

    Args:
      cfg: the model section (its keys from ``path``'s config.json, see
        ``config.hf_config``).
      abstract: ``{"params", "router_bias"}`` of ShapeDtypeStructs (the
        train state's); the loaded arrays take their dtypes.
      shardings: the same tree of ``jax.sharding.Sharding``.

    Raises:
      HFCheckpointError: the directory does not hold ``cfg``'s model: a
        tensor missing, unexpected, of the wrong shape or dtype, FP8 without
        its scales, or MTP copies of the embedding/head that differ.
      ValueError: the mapping does not cover ``abstract`` (a bug, not input).
    """
    plan = _plan(path, cfg)
    targets, places = _paths(abstract), _paths(shardings)
    leaves = {leaf.path: leaf for leaf in plan.mapping.leaves}
    if set(leaves) != set(targets):
        diff = sorted(map(str, set(leaves) ^ set(targets)))
        raise ValueError(f"the {plan.layout} mapping and the model's parameters differ at {diff[:3]}")
    for key, leaf in leaves.items():
        if tuple(targets[key].shape) != leaf.shape:
            raise ValueError(f"mapping gives {key} shape {leaf.shape}, the model {tuple(targets[key].shape)}")
    out: dict = {}
    for key, leaf in leaves.items():
        _set(out, key, _build_leaf(plan, leaf, places[key], targets[key].dtype))
    return out
