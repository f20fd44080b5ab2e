"""Per-device memory of a training step, estimated from abstract shapes (no arrays, no device).

What the estimate adds up, per device, for a mesh of ``num_devices``:

* ``params``, ``optimizer``, ``router_bias``: the train state of
  ``train.step.init_state_fn`` from ``jax.eval_shape``, each array divided by
  the mesh ways it is sharded over (``parallel.sharding``'s rules, on an
  ``AbstractMesh`` of the target size, so 256 devices need not exist).
* ``grads``: one gradient per parameter in its dtype; with
  ``gradient_accumulation_steps > 1`` also the float32 accumulator.
* ``saved activations``: the residuals the forward pass keeps for the backward
  pass under the configured remat policy, read off the traced program
  (``jax``'s ``saved_residuals`` of the microbatch loss at the per-device
  batch), excluding the parameters themselves. Residuals the ``custom``
  policy sends to the host are reported apart (``offloaded``) and not counted.
* ``layer working set``: what the backward pass of one rematerialised layer
  holds while it recomputes that layer: the residuals of the largest layer
  with nothing rematerialised, measured as the difference between the model
  and the model with one layer fewer (0 for ``remat_policy=none``, where
  nothing is recomputed).
* ``loss-head gradient``: the cotangent of the logits [B, S, V] in the
  activation dtype (one per MTP head too); the float32 softmax it comes from
  is already a saved residual, and XLA computes the cotangent from it in one
  fusion.
* ``FP8 expert weight codes``: with ``gmm_fp8_weights_once_per_step`` under gradient
  accumulation where the FP8 kernels run on one device, both byte layouts of every
  expert weight and its 128x128 scales, held through the step (``train.step``).
* ``checkpoint snapshot``: with ``checkpoint_device_snapshot``, one more copy
  of the train state (parameters, optimizer state, router bias and counters),
  which lives beside the steps while Orbax copies it to the host.

The backward pass meets the head first and then one layer at a time, so the
two transients do not coexist: the total is the state, the snapshot, the saved
activations and the larger of the working set and the head gradient.

XLA's own temporaries are not modelled: fusion buffers, the expansion of
``lax.ragged_dot`` into a masked dense product (``gmm_backend=xla``), and
the expert-parallel receive buffers (``ragged_buffer_factor`` x the balanced
load). ``compiled_bytes`` reads XLA's compiled memory analysis instead, on
the real device. ``benchmarks/notes/memory.md`` states the estimate's error
against peaks measured on the H200.

cuDNN flash attention cannot be traced without cuDNN, so on a machine
without it the estimate traces a stand-in with the same residuals
(q, k, v, the output and the float32 log-sum-exp [B, H, S]).
"""

import contextlib
import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from dropless.config.sections import ModelConfig

GiB = 2**30
MiB = 2**20

# HBM per device as the driver reports it (nvidia-smi's total), by the names
# ``--device`` takes. JAX may use XLA_PYTHON_CLIENT_MEM_FRACTION of it (0.75 by default).
DEVICE_MEMORY = {
    "h100": 81559 * MiB,
    "h200": 143771 * MiB,
    "b200": 183359 * MiB,
}
DEFAULT_MEM_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class Target:
    """The hardware the estimate is for: device name, HBM bytes, the fraction JAX may use."""

    name: str
    memory_bytes: int
    mem_fraction: float

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.mem_fraction)


def target(name: str, env: dict | None = None, memory_gib: float | None = None) -> Target:
    """The ``Target`` of a device name ("h200", "cpu" ...).

    ``cpu`` is this machine's physical memory (all of it usable). The GPU
    fraction is ``XLA_PYTHON_CLIENT_MEM_FRACTION`` from ``env`` (the config's
    environment keys), else from the environment, else 0.75.

    Raises:
      ValueError: an unknown device name without ``memory_gib``, or a bad fraction.
    """
    name = name.lower()
    if name == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Target("cpu", int(memory_gib * GiB) if memory_gib else total, 1.0)
    if memory_gib is None and name not in DEVICE_MEMORY:
        raise ValueError(f"--device {name!r}: unknown device; known: {', '.join(DEVICE_MEMORY)}, "
                         "cpu (or give --memory-gib)")
    text = (env or {}).get("XLA_PYTHON_CLIENT_MEM_FRACTION",
                           os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""))
    try:
        fraction = float(text) if text else DEFAULT_MEM_FRACTION
    except ValueError:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} is not a number") from None
    if not 0 < fraction <= 1:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction} must be in (0, 1]")
    memory = int(memory_gib * GiB) if memory_gib else DEVICE_MEMORY[name]
    return Target(name, memory, fraction)


@dataclasses.dataclass
class Estimate:
    """Bytes per device of each part (see the module docstring); ``total`` is the peak."""

    params: int
    grads: int
    optimizer: int
    other_state: int
    saved_activations: int
    offloaded_activations: int
    layer_working_set: int
    head_gradient: int
    checkpoint_bytes: int  # one checkpoint, all devices together
    num_params: int
    per_device_batch: int
    mesh: dict
    snapshot: int = 0  # checkpoint_device_snapshot's copy of the state
    fp8_weight_codes: int = 0  # gmm_fp8_weights_once_per_step's codes, held through the step

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer + self.other_state

    @property
    def activations(self) -> int:
        return self.saved_activations + max(self.layer_working_set, self.head_gradient)

    @property
    def total(self) -> int:
        return self.state + self.snapshot + self.fp8_weight_codes + self.activations

    def rows(self) -> list[tuple[str, int]]:
        snapshot = [("checkpoint snapshot (checkpoint_device_snapshot)", self.snapshot)] if self.snapshot else []
        return [("parameters", self.params), ("gradients", self.grads),
                ("optimizer state", self.optimizer), ("router bias, counters", self.other_state),
                *snapshot,
                *([("FP8 expert weight codes (gmm_fp8_weights_once_per_step)", self.fp8_weight_codes)]
                  if self.fp8_weight_codes else []),
                ("saved activations (remat policy)", self.saved_activations),
                ("layer working set (recompute)", self.layer_working_set),
                ("loss-head gradient", self.head_gradient)]

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(state=self.state, activations=self.activations, total=self.total,
                   total_gib=self.total / GiB)
        return out


def _nbytes(x) -> int:
    return int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def _shard_bytes(x, spec, mesh_shape: dict) -> int:
    """Bytes of the largest shard of ``x`` under PartitionSpec ``spec``."""
    shape = list(x.shape)
    for i, axes in enumerate(tuple(spec)[:len(shape)]):
        if axes is None:
            continue
        ways = math.prod(mesh_shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
        shape[i] = -(-shape[i] // ways)
    return int(np.prod(shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def state_bytes(abstract: dict, mesh_shape: dict) -> dict[str, int]:
    """Per-device bytes of each top-level entry of the abstract train state."""
    from jax.sharding import AbstractMesh

    from dropless.parallel import sharding
    from dropless.parallel.mesh import MESH_AXES

    mesh = AbstractMesh(tuple(mesh_shape[a] for a in MESH_AXES), MESH_AXES)
    specs = sharding.state_specs(mesh, abstract)
    out = {}
    for key in abstract:
        leaves = jax.tree.leaves(abstract[key])
        spec_leaves = jax.tree.leaves(specs[key], is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
        out[key] = sum(_shard_bytes(x, s, mesh_shape) for x, s in zip(leaves, spec_leaves))
    return out


# --- cuDNN flash attention stand-in (tracing only) -------------------------------------------


@jax.custom_vjp
def _flash_standin(q_BSHQ, k_BTHQ, v_BTHQ):
    # GQA: k and v have K <= H heads; kv head j serves query heads j*H/K .. (j+1)*H/K - 1.
    v_BTHQ = jnp.repeat(v_BTHQ, q_BSHQ.shape[2] // v_BTHQ.shape[2], axis=2)
    return v_BTHQ * jnp.ones((), v_BTHQ.dtype)


def _flash_standin_fwd(q_BSHQ, k_BTHQ, v_BTHQ):
    out_BSHQ = _flash_standin(q_BSHQ, k_BTHQ, v_BTHQ)
    b, s, h, _ = q_BSHQ.shape
    lse_BHS = jnp.zeros((b, h, s), jnp.float32) + jnp.sum(q_BSHQ[:1, :1, :1, :1]).astype(jnp.float32)
    return out_BSHQ, (q_BSHQ, k_BTHQ, v_BTHQ, out_BSHQ, lse_BHS)


def _flash_standin_bwd(res, g):
    q, k, v, _, _ = res
    b, t, kv, d = v.shape
    return jnp.zeros_like(q), jnp.zeros_like(k), g.reshape(b, t, kv, -1, d).sum(3).astype(v.dtype)


_flash_standin.defvjp(_flash_standin_fwd, _flash_standin_bwd)


def _standin_attention(q_BSHQ, k_BTHQ, v_BTHV, *, scale: float, implementation="cudnn",
                       unpadded_v: bool = False):
    """``attention.fused_attention``'s residuals: v padded to Q as the public cuDNN call
    takes it, or (``unpadded_v``, the private call) v and the output at V."""
    del scale, implementation
    qk_dim, v_dim = q_BSHQ.shape[-1], v_BTHV.shape[-1]
    if unpadded_v or v_dim == qk_dim:
        return _flash_standin(q_BSHQ, k_BTHQ, v_BTHV)
    v_BTHQ = jnp.pad(v_BTHV, [(0, 0)] * 3 + [(0, qk_dim - v_dim)])
    return _flash_standin(q_BSHQ, k_BTHQ, v_BTHQ)[..., :v_dim]


@contextlib.contextmanager
def _traceable_attention(model: ModelConfig):
    """Swap cuDNN attention for the stand-in while tracing, unless cuDNN attention can trace here
    (MLA and GQA both reach it through ``attention.attend``)."""
    from dropless.nn import attention

    if model.mla.attention != "cudnn_flash_te" or jax.devices()[0].platform == "gpu":
        yield
        return
    saved = attention.fused_attention
    attention.fused_attention = _standin_attention
    try:
        yield
    finally:
        attention.fused_attention = saved


# --- activations -------------------------------------------------------------------------------


def _residuals(model: ModelConfig, batch: int, seq: int, seed: int = 0):
    """[(aval, description)] saved by the forward pass of one microbatch's loss, params excluded."""
    import optax
    from jax._src.ad_checkpoint import saved_residuals

    from dropless.train import remat as remat_lib
    from dropless.train import step as step_lib

    graphdef, init = step_lib.init_state_fn(model, optax.identity(), seed, remat_lib.layer_remat(model))
    abstract = jax.eval_shape(init)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    weights = jax.ShapeDtypeStruct((batch, seq), jnp.float32)

    def loss(params, router_bias, tokens, weights):
        return step_lib.loss_fn(params, router_bias, graphdef, model, tokens, tokens, weights)[0]

    with _traceable_attention(model):
        res = saved_residuals(loss, abstract["params"], abstract["router_bias"], tokens, weights)
    return [(aval, src) for aval, src in res if "from the argument" not in src]


def _on_host(aval) -> bool:
    return "host" in str(getattr(aval, "memory_space", "")).lower()


def saved_activation_bytes(model: ModelConfig, batch: int, seq: int) -> tuple[int, int]:
    """(bytes kept on the device, bytes offloaded to the host) of one microbatch's residuals.

    A residual the policy offloads has a host memory space in the traced program.
    """
    device = host = 0
    for aval, _ in _residuals(model, batch, seq):
        if _on_host(aval):
            host += _nbytes(aval)
        else:
            device += _nbytes(aval)
    return device, host


def layer_working_set(model: ModelConfig, batch: int, seq: int) -> int:
    """Residuals of the largest single layer with nothing rematerialised (see the docstring)."""
    if model.remat_policy == "none":
        return 0
    bare = dataclasses.replace(model, remat_policy="none", remat_custom=(), mtp_num_layers=0)

    def total(m):
        return sum(_nbytes(aval) for aval, _ in _residuals(m, batch, seq) if not _on_host(aval))

    full = total(bare)
    layers, dense = bare.num_decoder_layers, bare.first_num_dense_layers
    candidates = []
    if layers - dense >= 1 and layers >= 2:  # one MoE layer fewer
        candidates.append(full - total(dataclasses.replace(bare, num_decoder_layers=layers - 1)))
    if dense >= 1 and layers >= 2:  # one dense layer fewer
        candidates.append(full - total(dataclasses.replace(
            bare, num_decoder_layers=layers - 1, first_num_dense_layers=dense - 1)))
    return max(candidates, default=full)


# --- the estimate ------------------------------------------------------------------------------


def estimate(model: ModelConfig, *, per_device_batch: int, seq: int, accum: int,
             mesh_shape: dict, optimizer=None, device_snapshot: bool = False) -> Estimate:
    """Per-device memory of one training step of ``model`` on a mesh of ``mesh_shape``.

    Args:
      per_device_batch: sequences per device per microbatch (whole, >= 1).
      seq: tokens per sequence.
      accum: gradient-accumulation microbatches.
      mesh_shape: {data, fsdp, expert, tensor: ways}.
      optimizer: the ``OptimizerConfig`` (its ``mu_dtype`` sizes the first moment).
      device_snapshot: count ``checkpoint_device_snapshot``'s copy of the state.

    Raises:
      ValueError: a model config the trainer would reject.
    """
    from dropless.config.sections import OptimizerConfig
    from dropless.train import checkpoint as ckpt_lib
    from dropless.train import optimizer as opt_lib
    from dropless.train import remat as remat_lib
    from dropless.train import step as step_lib

    tx = opt_lib.make_optimizer(optimizer or OptimizerConfig(), 1)
    _, init = step_lib.init_state_fn(model, tx, 0, remat_lib.layer_remat(model))
    abstract = jax.eval_shape(init)
    per_key = state_bytes(abstract, mesh_shape)
    params = per_key["params"]
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract["params"]))
    grads = params
    if accum > 1:  # the float32 accumulator beside each microbatch's gradients
        grads += sum(_shard_bytes(x, s, mesh_shape) * 4 // jnp.dtype(x.dtype).itemsize
                     for x, s in _leaf_specs(abstract["params"], mesh_shape))
    saved, host = saved_activation_bytes(model, per_device_batch, seq)
    heads = 1 + model.mtp_num_layers
    snapshot = sum(per_key.values()) if device_snapshot else 0
    return Estimate(
        params=params, grads=grads, optimizer=per_key["opt_state"],
        other_state=sum(v for k, v in per_key.items() if k not in ("params", "opt_state")),
        saved_activations=saved, offloaded_activations=host,
        layer_working_set=layer_working_set(model, per_device_batch, seq),
        head_gradient=heads * per_device_batch * seq * model.vocab_size * jnp.dtype(model.dtype).itemsize,
        checkpoint_bytes=ckpt_lib.save_bytes(abstract),
        num_params=num_params, per_device_batch=per_device_batch, mesh=dict(mesh_shape),
        snapshot=snapshot,
        fp8_weight_codes=fp8_weight_codes_bytes(model, abstract["params"], accum, mesh_shape),
    )


def fp8_weight_codes_bytes(model: ModelConfig, params, accum: int, mesh_shape: dict) -> int:
    """Bytes of the expert weights' FP8 codes ``gmm_fp8_weights_once_per_step`` holds through
    a step: each expert weight's two one-byte layouts and its float32 128x128 scales, where
    the trainer makes them (more than one microbatch, the FP8 kernels on a Hopper GPU, one
    device: ``moe.MoEBlock.fp8_weight_codes``); else 0. On the DeepSeek proxy that is 7.9 GiB;
    its measured peak rose by 4.0 GiB over quantizing per microbatch
    (``step-fp8-ga2-weights-once-20261205-032126``), since there remat ``minimal`` already
    keeps one layout per layer for dgrad, which the codes then stand in for."""
    from dropless.ops import quant
    from dropless.ops.gmm import quantized
    from dropless.parallel import sharding

    moe = model.moe
    if not (accum > 1 and moe.gmm_fp8_weights_once_per_step and moe.sparse_matmul
            and math.prod(mesh_shape.values()) == 1):
        return 0
    tile = quant.BLOCKWISE_TILE
    total = 0
    for path, w in jax.tree_util.tree_flatten_with_path(params)[0]:
        if getattr(path[-1], "key", None) in sharding.EXPERT_WEIGHTS and quantized.kernels_run_on_hopper(
                moe.gmm_fp8_impl, moe.gmm_quantization, moe.gmm_backend, w.shape[-3:]):
            *lead, k, n = w.shape
            total += math.prod(lead) * (2 * k * n + 4 * -(-k // tile) * -(-n // tile))
    return total


def _leaf_specs(tree, mesh_shape):
    from jax.sharding import AbstractMesh, PartitionSpec

    from dropless.parallel import sharding
    from dropless.parallel.mesh import MESH_AXES

    mesh = AbstractMesh(tuple(mesh_shape[a] for a in MESH_AXES), MESH_AXES)
    specs = jax.tree.leaves(sharding.state_specs(mesh, tree), is_leaf=lambda s: isinstance(s, PartitionSpec))
    return list(zip(jax.tree.leaves(tree), specs))


def keys_to_lower(model: ModelConfig, est: Estimate, usable: int) -> list[str]:
    """The config keys that reduce the largest parts of ``est``, most effective first."""
    keys = []
    if est.snapshot and est.total - est.snapshot <= usable:  # fits without the copy
        keys.append("checkpoint_device_snapshot=false (a second copy of the state)")
    if model.mla.attention == "dot_product" and est.layer_working_set > usable // 4:
        keys.append("attention=cudnn_flash_te (dot_product materialises the scores)")
    if est.activations > est.state:
        keys += ["per_device_batch_size", "max_target_length"]
        if model.remat_policy != "full":
            keys.append("remat_policy=full")
    if est.state >= est.activations or est.state > usable:
        keys.append("more devices (--devices; ici_fsdp_parallelism / ici_expert_parallelism shard the state)")
        if model.weight_dtype == "float32":
            keys.append("weight_dtype=bfloat16")
    return keys


def compiled_bytes(compiled) -> dict:
    """XLA's memory analysis of a compiled step: argument, output, temp, alias and peak bytes."""
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    out = {k: int(getattr(ma, f"{k}_size_in_bytes", 0))
           for k in ("argument", "output", "temp", "alias", "generated_code")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out
