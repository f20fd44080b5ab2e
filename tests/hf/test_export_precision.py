"""A bfloat16 export is the parameters rounded to nearest bfloat16, nothing else.

The parameters are fresh float32 values (the fixtures' weights are
bf16-representable, so rounding them would change nothing and prove nothing),
with exact ties planted in every leaf (low 16 bits 0x8000, on both an even and
an odd bf16 mantissa) so that round-half-away or truncation would fail too.
Written as bfloat16 and loaded back by ``hf_model_path``'s loader into float32
parameters, every leaf must hold exactly ``jnp.asarray(p, jnp.bfloat16)``, bit
for bit, through the per-expert split, the transposes and the gate|up fusion;
DeepSeek-V3's router weight and balancing bias (``e_score_correction_bias``),
which the published checkpoint and transformers keep float32, must come back
as the float32 bits they were. With the parameters equal bit for bit, the
float32 forward of the loaded export and of the rounded parameters are the
same computation: the logit gap of a bf16 export against its checkpoint is the
rounding of the weights alone.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixture import FIXTURES, QWEN3, assert_bitwise_equal, load_params, model_cfg, save_checkpoint

from dropless import cli
from dropless.hf.export import precision_note, write_hf
from dropless.hf.safetensors_io import TensorDir

SOURCES = {"deepseek_v3": os.path.join(FIXTURES, "published"), "qwen3_moe": os.path.join(QWEN3, "published")}
# The tensors DeepSeek-V3 ships (and transformers keeps) in float32; Qwen3-MoE ships its router in bf16.
FLOAT32_TENSORS = {"deepseek_v3": ("mlp.gate.weight", "mlp.gate.e_score_correction_bias"), "qwen3_moe": ()}


def _random_state(src: str, seed: int = 0) -> tuple:
    """(cfg, ``{"params", "router_bias"}`` of ``src``'s model with fresh float32 values and planted ties)."""
    cfg = model_cfg(src)
    template = load_params(src, cfg)
    rng = np.random.default_rng(seed)

    def fresh(path, x):
        x = np.asarray(x)
        if "router_bias" in jax.tree_util.keystr(path) and not np.any(x):
            return x  # Qwen3-MoE: no HF tensor, must stay zero
        v = (rng.standard_normal(x.shape) * 0.05).astype(np.float32)
        bits = v.reshape(-1).view(np.uint32)
        bits[:2] = (np.array([0x3F80, 0x3F81], np.uint32) << 16) | 0x8000  # ties: 1 + 2^-8, 1 + 3 * 2^-8
        return v

    state = jax.tree_util.tree_map_with_path(fresh, template)
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        assert x.dtype == np.float32, jax.tree_util.keystr(path)
    return cfg, state


def _rounded(state: dict, keep_router_float32: bool) -> dict:
    """``state`` with every leaf rounded to nearest-even bfloat16 (back in float32),
    the router and its bias kept when ``keep_router_float32``."""
    def rnd(path, x):
        if keep_router_float32 and "router" in jax.tree_util.keystr(path):
            return x
        return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    return jax.tree_util.tree_map_with_path(rnd, state)


@pytest.mark.parametrize("arch", sorted(SOURCES))
def test_bf16_export_is_the_parameters_rounded_to_nearest_even(arch, tmp_path):
    cfg, state = _random_state(SOURCES[arch])
    write_hf(state, cfg, str(tmp_path), dtype="bfloat16")

    tdir = TensorDir(str(tmp_path))
    f32 = sorted(n for n in tdir.names if tdir.dtype(n) == "F32")
    assert f32 == sorted(n for n in tdir.names if n.endswith(FLOAT32_TENSORS[arch])), f32
    assert all(tdir.dtype(n) == "BF16" for n in tdir.names if n not in f32)

    want = _rounded(state, keep_router_float32=arch == "deepseek_v3")
    got = load_params(str(tmp_path), model_cfg(str(tmp_path)))
    assert_bitwise_equal(got, want)
    # The planted ties went to the even mantissa: 1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6.
    embed = np.asarray(got["params"]["embed"]["embedding"]).reshape(-1)
    assert embed[:2].tolist() == [1.0, 1.0 + 2**-6]


@pytest.fixture
def float32_checkpoint(tmp_path):
    """A dropless checkpoint step of float32 parameters (the DeepSeek-V3 fixture's model)."""
    cfg, state = _random_state(SOURCES["deepseek_v3"])
    return save_checkpoint(tmp_path / "run", cfg, state)


def test_export_hf_says_when_it_rounds_the_weights(float32_checkpoint, tmp_path, capsys):
    """A bfloat16 export of float32 parameters says so in one line; a float32 export does not."""
    assert cli.main(["export-hf", float32_checkpoint, "--out", str(tmp_path / "bf16")]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "rounded" in ln]
    assert len(lines) == 1 and "float32" in lines[0] and "bfloat16" in lines[0], lines
    assert cli.main(["export-hf", float32_checkpoint, "--out", str(tmp_path / "f32"), "--dtype", "float32"]) == 0
    assert "rounded" not in capsys.readouterr().out


def test_no_rounding_note_when_the_parameters_are_already_bf16():
    """bf16 parameters (``weight_dtype=bfloat16``) lose nothing in a bf16 export: no note.
    Qwen3-MoE keeps nothing in float32, so its note names no router."""
    cfg, state = _random_state(SOURCES["qwen3_moe"])
    note = precision_note(state, cfg, "bfloat16")
    assert "rounded" in note and "router" not in note, note
    bf16 = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16)), state)
    assert precision_note(bf16, cfg, "bfloat16") is None
    assert precision_note(state, cfg, "float32") is None
