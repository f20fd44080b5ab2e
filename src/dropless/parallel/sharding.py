"""Sharding rules: logical axis names -> mesh axes, for parameters and activations.

Mesh axes: ``data``, ``fsdp``, ``expert``, ``tensor`` (``parallel.mesh``).

Activations (logical names, MaxText-style; ``logical_spec``)::

    batch        -> (data, fsdp, expert)   tokens are split over every non-tensor axis
    exp          -> expert                  the expert axis of expert-sharded arrays
    seq, embed, mlp, vocab, heads -> replicated (no sequence or tensor parallelism yet)

The expert axis carries a share of the batch outside the MoE layers (as in
MaxText); inside them ``parallel.ep`` exchanges tokens across it.

Parameters and optimizer state (``state_specs``), by path:

* routed expert weights ``.../{wi, wi_0, wi_1, wo}`` ([(L,) E, X, Y]; dense
  MLP weights of those names are ``.../wi_0/kernel`` and do not match):
  E over ``expert``; the largest of X, Y divisible by the fsdp size over ``fsdp``;
* everything else with >= 1 axis: ZeRO-3 style over ``fsdp`` x ``expert``
  (the batch is split over both): the largest axis divisible by their product,
  else by the fsdp size, else replicated; never the leading [L] axis of a
  scanned layer stack (``.../layers/...``), which the scan walks one slice at
  a time;
* the router bias (.../router_bias) and scalars: replicated.

Optimizer states mirror the parameter tree (Optax), so the same rule finds
their expert weights by path.
"""

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

BATCH_AXES = ("data", "fsdp", "expert")
EXPERT_AXIS = "expert"
LOGICAL_RULES = {
    "batch": BATCH_AXES,
    "exp": EXPERT_AXIS,
    "seq": None,
    "embed": None,
    "mlp": None,
    "vocab": None,
    "heads": None,
}
EXPERT_WEIGHTS = ("wi", "wi_0", "wi_1", "wo")


def logical_spec(names) -> P:
    """PartitionSpec of an array whose axes carry these logical names.

    Raises:
      KeyError: a name without a rule.
    """
    for name in names:
        if name is not None and name not in LOGICAL_RULES:
            raise KeyError(f"no sharding rule for logical axis {name!r}; known: {sorted(LOGICAL_RULES)}")
    return P(*(None if n is None else LOGICAL_RULES[n] for n in names))


def logical_sharding(mesh: Mesh, names) -> NamedSharding:
    """``NamedSharding`` on ``mesh`` of ``logical_spec(names)``."""
    return NamedSharding(mesh, logical_spec(names))


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_names(path) -> tuple[str, ...]:
    """('params', 'moe_layers', 'layers', 'moe', 'wi') from a pytree key path."""
    return tuple(_key_name(k) for k in path)


def _largest_divisible(shape, ways, skip=()):
    """Index of the largest axis divisible by ``ways`` (not in ``skip``), or None."""
    candidates = [(size, i) for i, size in enumerate(shape) if i not in skip and size % ways == 0]
    return max(candidates)[1] if candidates else None


def expert_weight_spec(shape, mesh_shape) -> P:
    """[(L,) E, X, Y]: E over expert, the larger divisible of X, Y over fsdp."""
    spec = [None] * len(shape)
    e_axis = len(shape) - 3
    spec[e_axis] = EXPERT_AXIS
    fsdp = mesh_shape.get("fsdp", 1)
    if fsdp > 1:
        axis = _largest_divisible(shape, fsdp, skip=range(e_axis + 1))
        if axis is not None:
            spec[axis] = "fsdp"
    return P(*spec)


def dense_spec(shape, mesh_shape, stacked=False) -> P:
    """ZeRO-3 rule of a non-expert array (see the module docstring)."""
    skip = (0,) if stacked else ()
    fsdp, expert = mesh_shape.get("fsdp", 1), mesh_shape.get(EXPERT_AXIS, 1)
    for axes, ways in ((("fsdp", EXPERT_AXIS), fsdp * expert), (("fsdp",), fsdp)):
        if ways == 1:
            continue
        axis = _largest_divisible(shape, ways, skip)
        if axis is not None:
            spec = [None] * len(shape)
            spec[axis] = axes if len(axes) > 1 else axes[0]
            return P(*spec)
    return P()


def array_spec(names, shape, mesh_shape) -> P:
    """The PartitionSpec of one state array, from its path names and shape."""
    if not shape or "router_bias" in names:
        return P()
    # MoEBlock's expert weights are Params named wi/wi_0/wi_1/wo themselves;
    # the dense MLPs' weights of those names end in .../kernel.
    if names and names[-1] in EXPERT_WEIGHTS and len(shape) >= 3:
        return expert_weight_spec(shape, mesh_shape)
    return dense_spec(shape, mesh_shape, stacked="layers" in names)


def state_specs(mesh: Mesh, tree):
    """PartitionSpecs for a pytree of arrays / ShapeDtypeStructs (the rules above)."""
    mesh_shape = dict(mesh.shape)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: array_spec(path_names(path), tuple(x.shape), mesh_shape), tree
    )


def state_shardings(mesh: Mesh, tree):
    """NamedShardings for a pytree of arrays / ShapeDtypeStructs (the rules above)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(mesh, tree),
                        is_leaf=lambda x: isinstance(x, P))
