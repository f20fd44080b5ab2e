"""Write dropless parameters as a Hugging Face directory (published layout).

``write_hf(state, cfg, out, dtype)`` writes ``config.json`` (the published
DeepSeek-V3 keys: ``rope_scaling`` + ``rope_theta``, ``num_nextn_predict_layers``)
and the tensors as sharded safetensors with ``model.safetensors.index.json``,
the directory transformers loads. The inverse of ``load.load_hf`` through the
same ``Mapping``: each leaf cell is cut back into its HF tensors, transposed
to ``[out, in]``. The router weight and balancing bias stay float32 (as
DeepSeek-V3 ships them); everything else takes ``dtype``. The MTP layers get
copies of the embedding and head, as the published checkpoint has.

A float32 export of float32 parameters is exact, so import -> export ->
import gives the same bits.
"""

import json
import os

import ml_dtypes
import numpy as np

from dropless.config import hf_config
from dropless.config.sections import ModelConfig
from dropless.hf import deepseek_v3
from dropless.hf.safetensors_io import write_sharded

EXPORT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def _leaf_value(state: dict, path: tuple):
    node = state
    for key in path:
        node = node[key]
    return node


def _tensors(state: dict, cfg: ModelConfig, dtype):
    """(HF name, array) pairs in layer order."""
    mapping = deepseek_v3.mapping(cfg, "published")
    for leaf in mapping.leaves:
        value = _leaf_value(state, leaf.path)
        if tuple(value.shape) != leaf.shape:
            raise ValueError(f"parameter {leaf.path} has shape {tuple(value.shape)}, the config {leaf.shape}")
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


def write_hf(state: dict, cfg: ModelConfig, out: str, *, dtype: str = "bfloat16",
             max_shard_bytes: int = 5 * 2**30) -> dict:
    """Write ``state`` (``{"params", "router_bias"}``, arrays or jax.Arrays) to ``out``.

    Returns:
      the index dict.

    Raises:
      ValueError: an unknown dtype, or parameters that do not fit ``cfg``.
      config.hf_config.HFConfigError: a model the DeepSeek-V3 layout cannot describe.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {tuple(EXPORT_DTYPES)}")
    config = hf_config.deepseek_v3_config(cfg, torch_dtype=dtype)
    os.makedirs(out, exist_ok=True)
    index = write_sharded(_tensors(state, cfg, EXPORT_DTYPES[dtype]), out, max_shard_bytes=max_shard_bytes)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return index
