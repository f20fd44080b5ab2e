"""Helpers of the Hugging Face tests: read the committed tiny DeepSeek-V3 (see
``tools/make_hf_fixture.py``) and write altered copies of it."""

import json
import os
import shutil

import numpy as np
from safetensors.numpy import save_file

from dropless.hf.safetensors_io import TensorDir

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def read_all(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a fixture directory, in its file dtype (FP8 as ml_dtypes)."""
    tdir = TensorDir(path)
    return {n: tdir.read(n) for n in sorted(tdir.names)}


def write_variant(src: str, out: str, tensors: dict[str, np.ndarray], config: dict | None = None) -> str:
    """A single-file copy of fixture ``src`` holding ``tensors`` (FP8 arrays are not
    supported by safetensors' numpy writer; variants drop or alter float tensors only)."""
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    if config is None:
        shutil.copy(os.path.join(src, "config.json"), os.path.join(out, "config.json"))
    else:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f)
    return out
