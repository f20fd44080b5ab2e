"""What the architectures share: a model's parameter leaves mapped onto HF tensor names.

Legend: L layers of one stack, E routed experts, D model dim, F expert (or
dense) hidden dim, V vocabulary; HF weights are ``[out, in]`` (torch Linear),
dropless kernels ``[in, out]``.

Every parameter leaf of the model (``{"params", "router_bias"}``, as
``train.step.split_model`` makes it) is described by a ``Leaf``: a grid over
its leading axes (the layer axis of a scanned stack, and for the per-expert
layout the expert axis) whose cells list the HF tensors (``Part``) that make
one cell, concatenated along the last axis after the ``[out, in] -> [in, out]``
transpose. The gate|up fused expert weight ``wi [L, E, D, 2F]`` is thus
``gate_proj`` and ``up_proj`` of each (layer, expert) side by side. A leaf
whose cells hold no Part is state the HF model does not have (the routing
bias of a model without one): loaded as zeros, and it must be zero to export.

The pieces the architectures share live here: the embedding, final norm and
head; a dense SwiGLU MLP; GQA attention (Qwen3-MoE, Mixtral); the routed
experts in either layout

* ``published`` (as released): per-expert
  ``model.layers.i.mlp.experts.j.{gate,up,down}_proj.weight`` (Mixtral's
  names differ: ``ExpertNames``);
* ``fused`` (transformers 5): ``mlp.experts.gate_up_proj [E, 2F, D]`` (gate
  rows first) and ``mlp.experts.down_proj [E, D, F]`` per layer;

and the stacking of per-layer entries into the leaves of a scanned stack.
An architecture module supplies its attention and decoder-layer entries.
"""

import dataclasses
import re
from typing import Callable

import numpy as np

from dropless.config.sections import ModelConfig

LAYOUTS = ("published", "fused")


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
    grid: object array over the leading axes; each cell a tuple of Parts
      (empty: no HF tensor, the values are zeros).
    transpose: HF ``[..., out, in]`` -> body ``[..., in, out]`` (parts
      concatenated along out); otherwise one part, body = HF shape.
    float32: exported in float32 whatever the export dtype (DeepSeek-V3's router).
    """

    path: tuple
    shape: tuple[int, ...]
    grid: np.ndarray
    transpose: bool
    float32: bool = False

    @property
    def lead(self) -> int:
        return self.grid.ndim

    @property
    def absent(self) -> bool:
        """No HF tensor behind it: zeros on load, must be zero on export."""
        return not any(self.grid.flat)


@dataclasses.dataclass
class Mapping:
    """All leaves of a model, plus HF tensors that must equal others (MTP copies)
    and name prefixes present in the directory but deliberately not loaded."""

    leaves: list[Leaf]
    aliases: dict[str, str]
    skipped_prefixes: tuple[str, ...] = ()


# An entry is one leaf of one layer: (path within the layer, grid of Parts,
# body shape, transpose, float32). A path starting with None is in the
# "router_bias" collection.
Entry = tuple


def cell(*parts: Part) -> np.ndarray:
    grid = np.empty((), object)
    grid[()] = tuple(parts)
    return grid


def entry(path, parts_grid, body, transpose=True, float32=False) -> Entry:
    return (path, parts_grid, tuple(body), transpose, float32)


def linear(path, name, d_in, d_out, **kw) -> Entry:
    """A ``[in, out]`` kernel from the HF ``[out, in]`` weight ``name``."""
    return entry(path, cell(Part(name, (d_out, d_in))), (d_in, d_out), **kw)


def vector(path, name, n, **kw) -> Entry:
    return entry(path, cell(Part(name, (n,))), (n,), transpose=False, **kw)


def zeros(path, shape) -> Entry:
    """State with no HF tensor (loaded as zeros)."""
    return entry(path, cell(), shape, transpose=False)


def mlp(path, p: str, d: int, f: int) -> list[Entry]:
    """A SwiGLU MLP ``p + {gate,up,down}_proj.weight``."""
    return [
        linear((*path, "wi_0", "kernel"), p + "gate_proj.weight", d, f),
        linear((*path, "wi_1", "kernel"), p + "up_proj.weight", d, f),
        linear((*path, "wo", "kernel"), p + "down_proj.weight", f, d),
    ]


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """The per-expert (published) tensor names: ``{prefix}{j}.{gate|up|down}.weight``
    under the layer prefix. The fused (transformers 5) names are the same for
    every architecture: ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``."""

    prefix: str = "mlp.experts."
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


def experts(cfg: ModelConfig, p: str, layout: str, names: ExpertNames = ExpertNames()) -> list[Entry]:
    """The routed experts of layer prefix ``p`` in ``layout`` (``wi`` or ``wi_0``/``wi_1``, ``wo``)."""
    moe, d = cfg.moe, cfg.emb_dim
    e, f = moe.num_experts, moe.moe_mlp_dim
    fused = moe.prefuse_moe_weights
    if layout == "fused":
        x = p + "mlp.experts."
        gate_up, down = Part(x + "gate_up_proj", (e, 2 * f, d)), Part(x + "down_proj", (e, d, f))
        rows = lambda lo, hi: dataclasses.replace(gate_up, rows=(lo, hi))  # noqa: E731
        wi = ([entry(("moe", "wi"), cell(gate_up), (e, d, 2 * f))] if fused else [
            entry(("moe", "wi_0"), cell(rows(0, f)), (e, d, f)),
            entry(("moe", "wi_1"), cell(rows(f, 2 * f)), (e, d, f))])
        return wi + [entry(("moe", "wo"), cell(down), (e, f, d))]

    x = p + names.prefix

    def per_expert(*projs):
        grid = np.empty((e,), object)
        for j in range(e):
            grid[j] = tuple(Part(f"{x}{j}.{name}.weight", shape) for name, shape in projs)
        return grid

    gate, up = (names.gate, (f, d)), (names.up, (f, d))
    wi = ([entry(("moe", "wi"), per_expert(gate, up), (d, 2 * f))] if fused else [
        entry(("moe", "wi_0"), per_expert(gate), (d, f)),
        entry(("moe", "wi_1"), per_expert(up), (d, f))])
    return wi + [entry(("moe", "wo"), per_expert((names.down, (d, f))), (f, d))]


def gqa_attention(cfg: ModelConfig, p: str) -> list[Entry]:
    """GQA's ``self_attn.{q,k,v,o}_proj.weight`` (no biases) of layer prefix ``p``,
    and its per-head ``q_norm``/``k_norm`` with ``use_qk_norm`` (Qwen3)."""
    gqa, d = cfg.gqa, cfg.emb_dim
    q, kv, hd = gqa.num_heads * gqa.head_dim, gqa.num_kv_heads * gqa.head_dim, gqa.head_dim
    a = p + "self_attn."
    out = [
        linear(("attention", "wq", "kernel"), a + "q_proj.weight", d, q),
        linear(("attention", "wk", "kernel"), a + "k_proj.weight", d, kv),
        linear(("attention", "wv", "kernel"), a + "v_proj.weight", d, kv),
        linear(("attention", "wo", "kernel"), a + "o_proj.weight", q, d),
    ]
    if gqa.use_qk_norm:
        out += [vector(("attention", "q_norm", "scale"), a + "q_norm.weight", hd),
                vector(("attention", "k_norm", "scale"), a + "k_norm.weight", hd)]
    return out


def decoder_layer(cfg: ModelConfig, p: str, moe: bool, layout: str,
                  attention: Callable[[ModelConfig, str], list[Entry]],
                  router: Callable[[ModelConfig, str], list[Entry]],
                  expert_names: ExpertNames = ExpertNames()) -> list[Entry]:
    """The entries of ``model.layers.i`` (``p``) every architecture shares: the two
    norms, ``attention``'s entries, then the dense MLP, or ``router``'s entries
    (router, balancing bias, shared experts) and the routed experts
    (``expert_names`` in the published layout)."""
    d = cfg.emb_dim
    out = [
        vector(("pre_attention_norm", "scale"), p + "input_layernorm.weight", d),
        vector(("pre_ffn_norm", "scale"), p + "post_attention_layernorm.weight", d),
        *attention(cfg, p),
    ]
    if not moe:
        return out + mlp(("mlp",), p + "mlp.", d, cfg.mlp_dim)
    return out + [*router(cfg, p), *experts(cfg, p, layout, expert_names)]


def leaf(prefix: tuple, ent: Entry, cells: list[np.ndarray] | None = None) -> Leaf:
    """The ``Leaf`` of ``ent`` under ``prefix``; with ``cells`` (one grid per
    layer) the leaf of a scanned stack, its leading axis the layers."""
    path, grid, body, transpose, float32 = ent
    collection = "params"
    if path[0] is None:
        collection, path = "router_bias", path[1:]
    if cells is not None:
        grid = np.empty((len(cells), *cells[0].shape), object)
        for i, c in enumerate(cells):
            grid[i, ...] = c
    return Leaf((collection, *prefix, *path), tuple(grid.shape) + body, grid, transpose, float32)


# layer_entries(cfg, "model.layers.i.", moe, layout) -> the entries of that layer.
LayerEntries = Callable[[ModelConfig, str, bool, str], list[Entry]]


def stack(cfg: ModelConfig, prefix: tuple, layers: range, moe: bool, layout: str,
          layer_entries: LayerEntries) -> list[Leaf]:
    """The leaves of the scanned stack of HF layers ``layers``."""
    per_layer = [layer_entries(cfg, f"model.layers.{i}.", moe, layout) for i in layers]
    return [leaf(prefix, per_layer[0][k], [lay[k][1] for lay in per_layer])
            for k in range(len(per_layer[0]))]


def decoder(cfg: ModelConfig, layout: str, layer_entries: LayerEntries) -> list[Leaf]:
    """Embedding, final norm, head and the dense-first then MoE stacks.

    Raises:
      ValueError: an unknown layout.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    d, v = cfg.emb_dim, cfg.vocab_size
    n, n_dense = cfg.num_decoder_layers, cfg.first_num_dense_layers
    leaves = [
        leaf((), entry(("embed", "embedding"), cell(Part("model.embed_tokens.weight", (v, d))),
                       (v, d), transpose=False)),
        leaf((), vector(("final_norm", "scale"), "model.norm.weight", d)),
        leaf((), linear(("head", "kernel"), "lm_head.weight", d, v)),
    ]
    if n_dense:
        leaves += stack(cfg, ("dense_layers", "layers"), range(n_dense), False, layout, layer_entries)
    if n > n_dense:
        leaves += stack(cfg, ("moe_layers", "layers"), range(n_dense, n), True, layout, layer_entries)
    return leaves


def detect_layout(names, per_expert_prefix: str = "mlp.experts.") -> str:
    """``published`` or ``fused`` from the tensor names (published when there is no MoE layer).

    ``per_expert_prefix``: ``ExpertNames.prefix`` of the architecture.

    Raises:
      ValueError: names of both layouts.
    """
    per_expert = re.compile(r"\." + re.escape(per_expert_prefix) + r"\d+\.")
    published = any(per_expert.search(n) for n in names)
    fused = any(n.endswith(".mlp.experts.gate_up_proj") for n in names)
    if published and fused:
        raise ValueError("the directory mixes per-expert (published) and fused (transformers 5) expert tensors")
    return "fused" if fused else "published"
