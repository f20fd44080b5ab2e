"""Helpers of the Hugging Face tests: read the committed tiny DeepSeek-V3,
Qwen3-MoE and Mixtral (see ``tools/make_hf_fixture.py``,
``tools/make_hf_fixture_qwen3.py``, ``tools/make_hf_fixture_mixtral.py``),
write altered copies, load them into dropless's parameters."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors.numpy import save_file

from dropless.config.loader import load_config
from dropless.hf.load import load_hf
from dropless.hf.safetensors_io import TensorDir
from dropless.nn.moe import MoEBlock, RouterBias
from dropless.train import step as step_lib
from dropless.train.checkpoint import write_manifest

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
QWEN3 = os.path.join(FIXTURES, "qwen3_moe")
MIXTRAL = os.path.join(FIXTURES, "mixtral")


def rel_fro(a, b) -> float:
    """Relative Frobenius error of ``a`` against the reference ``b``."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def model_cfg(path, *overrides):
    """The model section of ``hf_model_path=path`` (plus overrides)."""
    return load_config(None, [f"hf_model_path={path}", *overrides]).config.model()


def load_params(path, cfg) -> dict:
    """``{"params", "router_bias"}`` of the directory ``path``, on one device."""
    abstract_model = nnx.eval_shape(lambda: step_lib.build_model(cfg, 0))
    _, params, bias, _ = step_lib.split_model(abstract_model)
    abstract = {"params": params, "router_bias": bias}
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return load_hf(path, cfg, abstract, jax.tree.map(lambda _: one, abstract))


def load_model(path, *overrides):
    """(the concrete model with ``path``'s parameters, layers unrolled; the parameters)."""
    cfg = model_cfg(path, "scan_layers=false", *overrides)
    loaded = load_params(path, cfg)
    graphdef = nnx.split(nnx.eval_shape(lambda: step_lib.build_model(cfg, 0)), nnx.Param, RouterBias, ...)[0]
    return nnx.merge(graphdef, loaded["params"], loaded["router_bias"], {}), loaded


def logits_and_experts(model, tokens_BS, monkeypatch):
    """(float32 logits [B, S, V], routed experts [L_moe, B*S, K] sorted per token)
    of ``model`` (layers unrolled), the experts recorded in each MoE layer's router."""
    recorded = []
    route = MoEBlock._route

    def spy(self, x_TD):
        logits, decision = route(self, x_TD)
        recorded.append(decision.experts_TK)
        return logits, decision

    monkeypatch.setattr(MoEBlock, "_route", spy)

    @jax.jit
    def run(tokens):  # layers unrolled: each layer's experts are a value of this trace
        return model(tokens).logits_BSV, [jnp.sort(e, axis=-1) for e in recorded]

    logits, experts = run(jnp.asarray(tokens_BS))
    return np.asarray(logits), np.stack(experts)


def assert_bitwise_equal(a, b) -> None:
    """Two parameter trees with the same paths, dtypes, shapes and bits."""
    flat_a, flat_b = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), jax.tree_util.keystr(path)


def assert_same_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Two tensor dicts (``read_all``) with the same names, dtypes and bytes."""
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name].view(np.uint8), want[name].view(np.uint8), err_msg=name)


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


def save_checkpoint(run, cfg, state) -> str:
    """Step 0 of a dropless run directory ``run`` (a ``pathlib.Path``) holding ``state``,
    as ``export-hf`` reads it: ``checkpoints/0`` with its manifest, and the run's
    ``config.json`` with the model section ``cfg``. Returns the step directory."""
    step = run / "checkpoints" / "0"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(str(step / "model"), state)
    write_manifest(str(step))
    (run / "config.json").write_text(json.dumps({"model": dataclasses.asdict(cfg)}))
    return str(step)
