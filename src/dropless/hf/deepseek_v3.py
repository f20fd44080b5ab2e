"""DeepSeek-V3's Hugging Face tensor names, mapped onto dropless's parameters.

Legend: L layers of one stack, E routed experts, D model dim, F expert (or
dense) hidden dim, V vocabulary; HF weights are ``[out, in]`` (torch Linear),
dropless kernels ``[in, out]``.

Every parameter leaf of the model (``{"params", "router_bias"}``, as
``train.step.split_model`` makes it) is described by a ``Leaf``: a grid over
its leading axes (the layer axis of a scanned stack, and for the published
layout the expert axis) whose cells list the HF tensors (``Part``) that make
one cell, concatenated along the last axis after the ``[out, in] -> [in, out]``
transpose. The gate|up fused expert weight ``wi [L, E, D, 2F]`` is thus
``gate_proj`` and ``up_proj`` of each (layer, expert) side by side.

Two layouts of the same model:

* ``published`` (DeepSeek-V3 as released): per-expert
  ``model.layers.i.mlp.experts.j.{gate,up,down}_proj.weight``; the MTP layers
  follow the decoder as ``model.layers.{N+k}.*`` with ``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.norm`` and copies of the embedding
  (``embed_tokens``) and head (``shared_head.head``), which dropless shares
  with the main model: they are checked equal to the main ones, not loaded.
* ``fused`` (transformers 5): ``mlp.experts.gate_up_proj [E, 2F, D]`` (gate
  rows first) and ``mlp.experts.down_proj [E, D, F]`` per layer.

RoPE needs no permutation: config.json's ``rope_interleave=true`` (checked by
``config.hf_config``) is the interleaved pair layout ``nn.rope`` computes.
"""

import dataclasses
import re

import numpy as np

from dropless.config.sections import ModelConfig

LAYOUTS = ("published", "fused")
MODEL_TYPE = "deepseek_v3"


@dataclasses.dataclass(frozen=True)
class Part:
    """One HF tensor (or a range of its axis -2, the ``out`` axis) in a leaf cell."""

    name: str
    hf_shape: tuple[int, ...]
    rows: tuple[int, int] | None = None

    @property
    def length(self) -> int:
        """Its extent along the leaf's last axis."""
        if self.rows is not None:
            return self.rows[1] - self.rows[0]
        return self.hf_shape[-2] if len(self.hf_shape) >= 2 else self.hf_shape[-1]


@dataclasses.dataclass
class Leaf:
    """A dropless parameter leaf and where its values live in the HF directory.

    path: keys into ``{"params": ..., "router_bias": ...}``.
    shape: the leaf's shape, ``grid.shape + body``.
    grid: object array over the leading axes; each cell a tuple of Parts.
    transpose: HF ``[..., out, in]`` -> body ``[..., in, out]`` (parts
      concatenated along out); otherwise one part, body = HF shape.
    float32: exported in float32 whatever the export dtype (router, as V3 ships).
    """

    path: tuple
    shape: tuple[int, ...]
    grid: np.ndarray
    transpose: bool
    float32: bool = False

    @property
    def lead(self) -> int:
        return self.grid.ndim


@dataclasses.dataclass
class Mapping:
    """All leaves of a model, plus HF tensors that must equal others (MTP copies)
    and name prefixes present in the directory but deliberately not loaded."""

    leaves: list[Leaf]
    aliases: dict[str, str]
    skipped_prefixes: tuple[str, ...] = ()


def _cell(*parts: Part) -> np.ndarray:
    grid = np.empty((), object)
    grid[()] = tuple(parts)
    return grid


def _entry(path, parts_grid, body, transpose=True, float32=False):
    return (path, parts_grid, tuple(body), transpose, float32)


def _linear(path, name, d_in, d_out, **kw):
    """A ``[in, out]`` kernel from the HF ``[out, in]`` weight ``name``."""
    return _entry(path, _cell(Part(name, (d_out, d_in))), (d_in, d_out), **kw)


def _vector(path, name, n, **kw):
    return _entry(path, _cell(Part(name, (n,))), (n,), transpose=False, **kw)


def _attention(cfg: ModelConfig, p: str) -> list:
    mla, d = cfg.mla, cfg.emb_dim
    h, q = mla.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    a = p + "self_attn."
    out = []
    if mla.q_lora_rank > 0:
        out += [
            _linear(("attention", "wq_a", "kernel"), a + "q_a_proj.weight", d, mla.q_lora_rank),
            _vector(("attention", "q_norm", "scale"), a + "q_a_layernorm.weight", mla.q_lora_rank),
            _linear(("attention", "wq_b", "kernel"), a + "q_b_proj.weight", mla.q_lora_rank, h * q),
        ]
    else:
        out.append(_linear(("attention", "wq", "kernel"), a + "q_proj.weight", d, h * q))
    return out + [
        _linear(("attention", "wkv_a", "kernel"), a + "kv_a_proj_with_mqa.weight", d,
                mla.kv_lora_rank + mla.qk_rope_head_dim),
        _vector(("attention", "kv_norm", "scale"), a + "kv_a_layernorm.weight", mla.kv_lora_rank),
        _linear(("attention", "wkv_b", "kernel"), a + "kv_b_proj.weight", mla.kv_lora_rank,
                h * (mla.qk_nope_head_dim + mla.v_head_dim)),
        _linear(("attention", "wo", "kernel"), a + "o_proj.weight", h * mla.v_head_dim, d),
    ]


def _mlp(path, p: str, d: int, f: int) -> list:
    return [
        _linear((*path, "wi_0", "kernel"), p + "gate_proj.weight", d, f),
        _linear((*path, "wi_1", "kernel"), p + "up_proj.weight", d, f),
        _linear((*path, "wo", "kernel"), p + "down_proj.weight", f, d),
    ]


def _experts(cfg: ModelConfig, p: str, layout: str) -> list:
    moe, d = cfg.moe, cfg.emb_dim
    e, f = moe.num_experts, moe.moe_mlp_dim
    x = p + "mlp.experts."
    fused = moe.prefuse_moe_weights
    if layout == "fused":
        gate_up, down = Part(x + "gate_up_proj", (e, 2 * f, d)), Part(x + "down_proj", (e, d, f))
        rows = lambda lo, hi: dataclasses.replace(gate_up, rows=(lo, hi))  # noqa: E731
        wi = ([_entry(("moe", "wi"), _cell(gate_up), (e, d, 2 * f))] if fused else [
            _entry(("moe", "wi_0"), _cell(rows(0, f)), (e, d, f)),
            _entry(("moe", "wi_1"), _cell(rows(f, 2 * f)), (e, d, f))])
        return wi + [_entry(("moe", "wo"), _cell(down), (e, f, d))]

    def per_expert(*projs):
        grid = np.empty((e,), object)
        for j in range(e):
            grid[j] = tuple(Part(f"{x}{j}.{name}.weight", shape) for name, shape in projs)
        return grid

    gate, up = ("gate_proj", (f, d)), ("up_proj", (f, d))
    wi = ([_entry(("moe", "wi"), per_expert(gate, up), (d, 2 * f))] if fused else [
        _entry(("moe", "wi_0"), per_expert(gate), (d, f)),
        _entry(("moe", "wi_1"), per_expert(up), (d, f))])
    return wi + [_entry(("moe", "wo"), per_expert(("down_proj", (d, f))), (f, d))]


def _decoder_layer(cfg: ModelConfig, p: str, moe: bool, layout: str) -> list:
    """Entries ``(path within the layer, grid, body, transpose, float32)`` of ``model.layers.i``."""
    d = cfg.emb_dim
    out = [
        _vector(("pre_attention_norm", "scale"), p + "input_layernorm.weight", d),
        _vector(("pre_ffn_norm", "scale"), p + "post_attention_layernorm.weight", d),
        *_attention(cfg, p),
    ]
    if not moe:
        return out + _mlp(("mlp",), p + "mlp.", d, cfg.mlp_dim)
    e = cfg.moe.num_experts
    return out + [
        _linear(("moe", "router", "kernel"), p + "mlp.gate.weight", d, e, float32=True),
        # The bias lives in the "router_bias" collection; marked by a leading None.
        _vector((None, "moe", "router_bias"), p + "mlp.gate.e_score_correction_bias", e, float32=True),
        *_mlp(("moe", "shared_experts"), p + "mlp.shared_experts.", d,
              cfg.moe.shared_experts * cfg.moe.moe_mlp_dim),
        *_experts(cfg, p, layout),
    ]


def _leaf(prefix: tuple, entry, cells: list[np.ndarray] | None = None) -> Leaf:
    path, grid, body, transpose, float32 = entry
    collection = "params"
    if path[0] is None:
        collection, path = "router_bias", path[1:]
    if cells is not None:  # a scanned stack: one cell grid per layer
        grid = np.empty((len(cells), *cells[0].shape), object)
        for i, cell in enumerate(cells):
            grid[i, ...] = cell
    return Leaf((collection, *prefix, *path), tuple(grid.shape) + body, grid, transpose, float32)


def _stack(cfg: ModelConfig, prefix: tuple, layers: range, moe: bool, layout: str) -> list[Leaf]:
    per_layer = [_decoder_layer(cfg, f"model.layers.{i}.", moe, layout) for i in layers]
    return [_leaf(prefix, per_layer[0][k], [lay[k][1] for lay in per_layer])
            for k in range(len(per_layer[0]))]


def mapping(cfg: ModelConfig, layout: str, hf_mtp_layers: int = 0) -> Mapping:
    """The ``Mapping`` of ``cfg``'s model onto ``layout``'s tensor names.

    Args:
      hf_mtp_layers: MTP layers the directory holds; those past
        ``cfg.mtp_num_layers`` are skipped, not unexpected.

    Raises:
      ValueError: an unknown layout.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    d, v = cfg.emb_dim, cfg.vocab_size
    n, n_dense = cfg.num_decoder_layers, cfg.first_num_dense_layers
    leaves = [
        _leaf((), _entry(("embed", "embedding"), _cell(Part("model.embed_tokens.weight", (v, d))),
                         (v, d), transpose=False)),
        _leaf((), _vector(("final_norm", "scale"), "model.norm.weight", d)),
        _leaf((), _linear(("head", "kernel"), "lm_head.weight", d, v)),
    ]
    if n_dense:
        leaves += _stack(cfg, ("dense_layers", "layers"), range(n_dense), False, layout)
    if n > n_dense:
        leaves += _stack(cfg, ("moe_layers", "layers"), range(n_dense, n), True, layout)
    aliases = {}
    for k in range(cfg.mtp_num_layers):
        p = f"model.layers.{n + k}."
        entries = [
            _vector(("embed_norm", "scale"), p + "enorm.weight", d),
            _vector(("hidden_norm", "scale"), p + "hnorm.weight", d),
            _linear(("eh_proj", "kernel"), p + "eh_proj.weight", 2 * d, d),
            _vector(("final_norm", "scale"), p + "shared_head.norm.weight", d),
        ]
        for path, *rest in _decoder_layer(cfg, p, n > n_dense, layout):
            bias = path[0] is None
            entries.append((((None,) if bias else ()) + ("layer",) + (path[1:] if bias else path), *rest))
        leaves += [_leaf(("mtp", k), e) for e in entries]
        aliases[p + "embed_tokens.weight"] = "model.embed_tokens.weight"
        aliases[p + "shared_head.head.weight"] = "lm_head.weight"
    skipped = tuple(f"model.layers.{n + k}." for k in range(cfg.mtp_num_layers, hf_mtp_layers))
    return Mapping(leaves, aliases, skipped)


_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def detect_layout(names) -> str:
    """``published`` or ``fused`` from the tensor names (published when there is no MoE layer).

    Raises:
      ValueError: names of both layouts.
    """
    published = any(_PER_EXPERT.search(n) for n in names)
    fused = any(n.endswith(".mlp.experts.gate_up_proj") for n in names)
    if published and fused:
        raise ValueError("the directory mixes per-expert (published) and fused (transformers 5) expert tensors")
    return "fused" if fused else "published"
