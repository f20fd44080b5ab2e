"""Write dropless parameters as a Hugging Face directory (published layout).

``write_hf(state, cfg, out, dtype)`` writes the model as the architecture of
its attention type (``hf.architecture_of``: MLA as DeepSeek-V3, GQA as
Qwen3-MoE): ``config.json`` in the published keys (``config.hf_config.WRITERS``)
and the tensors as sharded safetensors with ``model.safetensors.index.json``,
the directory transformers loads. The inverse of ``load.load_hf`` through the
same ``Mapping``: each leaf cell is cut back into its HF tensors, transposed
to ``[out, in]``. Leaves marked float32 (DeepSeek-V3's router weight and
balancing bias, as it ships them) stay float32; everything else takes
``dtype``. Aliases (DeepSeek-V3's MTP copies of the embedding and head) are
written as the published checkpoint has them. State with no HF tensor (a
routing bias Qwen3-MoE does not have) must be zero.

A float32 export of float32 parameters is exact, so import -> export ->
import gives the same bits. A bfloat16 export rounds each float32 weight to
the nearest bfloat16 (ties to even, relative error at most 2^-8) and changes
nothing else: loaded back, the parameters are exactly ``jnp.asarray(p,
jnp.bfloat16)`` (``tests/hf/test_export_precision.py``). On a small, briefly
trained model that rounding can flip a token's routed experts, which moves
its logits by far more than 2^-8; ``precision_note`` is the line the command
prints about it.
"""

import json
import os

import ml_dtypes
import numpy as np

from dropless.config import hf_config
from dropless.config.sections import ModelConfig
from dropless.hf import architecture_of
from dropless.hf.safetensors_io import write_sharded

EXPORT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def _leaf_value(state: dict, path: tuple):
    node = state
    for key in path:
        node = node[key]
    return node


def _tensors(state: dict, cfg: ModelConfig, dtype):
    """(HF name, array) pairs in layer order."""
    arch = architecture_of(cfg)
    mapping = arch.mapping(cfg, "published")
    for leaf in mapping.leaves:
        value = _leaf_value(state, leaf.path)
        if tuple(value.shape) != leaf.shape:
            raise ValueError(f"parameter {leaf.path} has shape {tuple(value.shape)}, the config {leaf.shape}")
        if leaf.absent:
            if np.any(np.asarray(value)):
                raise ValueError(f"{'/'.join(map(str, leaf.path))} is nonzero but {arch.MODEL_TYPE} "
                                 "has no tensor for it")
            continue
        out_dtype = np.float32 if leaf.float32 else dtype
        for pos in np.ndindex(*leaf.grid.shape):
            cell = np.asarray(value[pos] if pos else value, np.float32)
            offset = 0
            for part in leaf.grid[pos]:
                if leaf.transpose:
                    piece = np.swapaxes(cell[..., offset: offset + part.length], -1, -2)
                else:
                    piece = cell
                offset += part.length
                yield part.name, piece.astype(out_dtype)
                if part.name in mapping.aliases.values():
                    for alias, target in mapping.aliases.items():
                        if target == part.name:
                            yield alias, piece.astype(out_dtype)


def precision_note(state: dict, cfg: ModelConfig, dtype: str) -> str | None:
    """One line saying which parameters a ``dtype`` export rounds, or None if it writes them exactly.

    Raises:
      ValueError: an unknown dtype.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {tuple(EXPORT_DTYPES)}")
    out = ml_dtypes.finfo(EXPORT_DTYPES[dtype])
    narrowed, kept = set(), False
    for leaf in architecture_of(cfg).mapping(cfg, "published").leaves:
        if leaf.absent:
            continue
        kept |= leaf.float32
        src = np.dtype(_leaf_value(state, leaf.path).dtype)
        if not leaf.float32 and ml_dtypes.finfo(src).nmant > out.nmant:
            narrowed.add(src.name)
    if not narrowed:
        return None
    return (f"{dtype} export of {'/'.join(sorted(narrowed))} parameters: weights rounded to the nearest "
            f"{dtype} (relative error <= 2^-{out.nmant + 1})"
            + ("; the router and its bias stay float32" if kept else "")
            + "; --dtype float32 writes them exactly")


def write_hf(state: dict, cfg: ModelConfig, out: str, *, dtype: str = "bfloat16",
             max_shard_bytes: int = 5 * 2**30) -> dict:
    """Write ``state`` (``{"params", "router_bias"}``, arrays or jax.Arrays) to ``out``.

    Returns:
      the index dict.

    Raises:
      ValueError: an unknown dtype, or parameters that do not fit ``cfg``
        (a nonzero state the architecture has no tensor for).
      config.hf_config.HFConfigError: a model its architecture's layout cannot describe.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {tuple(EXPORT_DTYPES)}")
    try:
        writer = hf_config.WRITERS[architecture_of(cfg).MODEL_TYPE]
    except ValueError as e:
        raise hf_config.HFConfigError(f"export: {e}") from None
    config = writer(cfg, torch_dtype=dtype)
    os.makedirs(out, exist_ok=True)
    index = write_sharded(_tensors(state, cfg, EXPORT_DTYPES[dtype]), out, max_shard_bytes=max_shard_bytes)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return index
