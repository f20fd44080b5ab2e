"""A fresh WGMMA accumulator costs no register writes: its first wgmma says scale-d = 0.

Why this exists. A Pallas Mosaic GPU kernel gets a new accumulator from
``pl.run_scoped(..., plgpu.ACC(shape))``. In jax 0.11.2 that lowers to
``WGMMAAccumulator.zero``: a splat of 0.0 through an LLVM optimization barrier,
so every accumulator register is written with a ``mov`` before the first
``wgmma.mma_async`` reads it (and ``wgmma_m64`` always passes ``scale-d = 1``).
The FP8 kernels take a fresh accumulator on every 128-wide contraction step (the
promotion into float32 needs each step's product alone), so that is 64 ``mov``
per warp per step: read off their PTX and Nsight Compute on the H200
(``benchmarks/fp8_kernel_anatomy.sh``, ``notes/fp8.md``), 36% of the forward
kernel's instructions and about a fifth of the wgrad kernel's, issued between a
step's promotion and its next wgmma. PTX's ``wgmma`` has the answer built in:
with ``scale-d`` false it computes ``D = A * B`` and never reads D, which is how
CUTLASS (``GMMA::ScaleOut::Zero``) and DeepGEMM start each block.

What this does (installed on import by ``mosaic_gmm``; jax 0.11.2 only, since
it rewrites that version's lowering of the ``mosaic_gpu`` dialect, which our
kernels use through warpgroup semantics; ``DROPLESS_WGMMA_FRESH=0`` turns it off):

- A ``mosaic_gpu.optimization_barrier`` on a splat of 0.0 whose one and only use
  is the accumulator of one ``mosaic_gpu.wgmma`` (what ``plgpu.ACC`` gives a body
  that starts with a wgmma) lowers to undefined registers, not to zeros. Any
  other barrier, or a zero accumulator read or carried anywhere else, lowers as
  jax lowers it.
- That wgmma's first ``wgmma.mma_async`` of each 64-row group then gets
  ``scale-d = 0``; the later ones of the same call accumulate onto it as before.
  The result is the same product: ``0 + x == x`` in float32, the sign of an
  all-zero product aside.

The rewrite is checked as it is made: if the instruction it expects is not
there, lowering fails with a message instead of computing from undefined
registers.
"""

import contextlib
import importlib
import logging
import os

import jax

_log = logging.getLogger(__name__)
JAX_VERSION = "0.11.2"  # the lowering this rewrites
_state = {"installed": False, "enabled": os.environ.get("DROPLESS_WGMMA_FRESH", "1") != "0",
          "fresh": False, "rewritten": 0}


def enabled():
    """Whether a lowering now would start fresh accumulators with scale-d = 0."""
    return _state["installed"] and _state["enabled"]


def rewritten_count():
    """How many wgmma instructions have been given scale-d = 0 in this process."""
    return _state["rewritten"]


@contextlib.contextmanager
def fresh_accumulators(on):
    """Lower kernels inside this block with the rewrite on or off (for A/B
    measurement: it acts when a kernel is lowered, i.e. on a jitted function's
    first call)."""
    before = _state["enabled"]
    _state["enabled"] = bool(on)
    try:
        yield
    finally:
        _state["enabled"] = before


def install():
    """Install the rewrite into Mosaic GPU's dialect lowering (idempotent). Returns
    whether it is installed; on another jax version it leaves jax alone."""
    if _state["installed"]:
        return True
    if jax.__version__ != JAX_VERSION:
        _log.info("wgmma_fresh: jax %s is not %s; fresh accumulators are zeroed as jax "
                  "does it", jax.__version__, JAX_VERSION)
        return False
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    lowering = importlib.import_module("jax.experimental.mosaic.gpu.dialect_lowering")
    wgmma_mod = importlib.import_module("jax.experimental.mosaic.gpu.wgmma")
    barrier_name, wgmma_name = "mosaic_gpu.optimization_barrier", "mosaic_gpu.wgmma"
    orig_barrier = lowering._lowerings[barrier_name]
    orig_wgmma = lowering._lowerings[wgmma_name]
    orig_m64 = wgmma_mod.wgmma_m64
    undefined = []  # the undefined-register Values handed out, to be recognized

    def barrier(ctx, op):
        if not (enabled() and _feeds_only_a_wgmma(op) and _is_zero_splat(op.operands[0])):
            return orig_barrier(ctx, op)
        [layout] = lowering.inference_utils.out_layouts(op)
        if layout != lowering.layouts_lib.to_layout_attr(fa.WGMMA_LAYOUT):
            return orig_barrier(ctx, op)
        shape = tuple(ir.VectorType(op.results[0].type).shape)
        regs = fa.FragmentedArray.splat(llvm.mlir_undef(ir.F32Type.get()), shape,
                                        fa.WGMMA_LAYOUT)
        undefined.append(regs.registers.flat[0])
        return [lowering.fragmented_array_to_ir(regs, op.results[0].type)]

    def wgmma(ctx, op):
        cast = op.operands[0].owner
        fresh = any(cast.operands[0] == u for u in undefined) if cast.operands else False
        _state["fresh"] = fresh
        try:
            return orig_wgmma(ctx, op)
        finally:
            _state["fresh"] = False

    def wgmma_m64(acc, a, *args, **kwargs):
        out = orig_m64(acc, a, *args, **kwargs)
        if _state["fresh"] and not _is_wgmma_result(acc.flat[0]):
            _scale_d_zero(out.flat[0], acc.flat[0], num_acc=acc.size,
                          num_a=4 if isinstance(a, fa.FragmentedArray) else 1)
        return out

    def _feeds_only_a_wgmma(op):
        if len(op.operands) != 1 or len(op.results) != 1:
            return False
        if not isinstance(op.operands[0].type, ir.VectorType):
            return False
        if ir.VectorType(op.operands[0].type).element_type != ir.F32Type.get():
            return False
        uses = list(op.results[0].uses)
        return (len(uses) == 1 and uses[0].operand_number == 0
                and uses[0].owner.name == wgmma_name)

    def _is_zero_splat(value):
        """0.0 everywhere: a constant, or a scalar constant broadcast (as a dialect
        op, or already lowered to a cast of the scalar with a splat layout)."""
        owner = value.owner
        if owner.name in ("vector.broadcast", "vector.splat") or (
                owner.name == "builtin.unrealized_conversion_cast"
                and len(owner.operands) == 1 and "WGSplatFragLayout" in str(
                    owner.attributes["layout"] if "layout" in owner.attributes else "")):
            owner = owner.operands[0].owner
        if owner.name != "arith.constant":
            return False
        attr = owner.attributes["value"]
        if isinstance(attr, ir.FloatAttr):
            return attr.value == 0.0
        if isinstance(attr, ir.DenseFPElementsAttr):
            return attr.is_splat and attr.get_splat_value().value == 0.0
        return False

    def _is_wgmma_result(value):
        owner = value.owner
        if not isinstance(owner, ir.OpView) or owner.name != "llvm.extractvalue":
            return False
        asm = owner.operands[0].owner
        return asm.name == "llvm.inline_asm" and "wgmma.mma_async" in str(
            asm.attributes["asm_string"])

    def _scale_d_zero(result, first_in, num_acc, num_a):
        """Find the first wgmma.mma_async of this wgmma_m64 call (the one reading
        ``first_in``) and make its scale-d operand the constant 0."""
        asm = result.owner.operands[0].owner  # extractvalue <- the last instruction
        for _ in range(64):
            if asm.name != "llvm.inline_asm" or "wgmma.mma_async" not in str(
                    asm.attributes["asm_string"]):
                break
            if asm.operands[0] == first_in:
                i = num_acc + num_a + 1  # [acc..., a..., b descriptor, scale-d, ...]
                use_out = asm.operands[i].owner
                if (use_out.name != "llvm.mlir.constant"
                        or ir.IntegerAttr(use_out.attributes["value"]).value != 1):
                    break
                with ir.InsertionPoint(asm):
                    i32 = ir.IntegerType.get_signless(32)
                    asm.operands[i] = llvm.ConstantOp(i32, ir.IntegerAttr.get(i32, 0)).result
                _state["rewritten"] += 1
                return
            asm = asm.operands[0].owner.operands[0].owner  # the previous instruction
        raise NotImplementedError(
            "wgmma_fresh: Mosaic GPU's wgmma lowering is not the one this rewrite "
            f"knows (jax {jax.__version__}); set DROPLESS_WGMMA_FRESH=0")

    lowering._lowerings[barrier_name] = barrier
    lowering._lowerings[wgmma_name] = wgmma
    wgmma_mod.wgmma_m64 = wgmma_m64
    _state["installed"] = True
    return True


__all__ = ["enabled", "fresh_accumulators", "install", "rewritten_count"]
