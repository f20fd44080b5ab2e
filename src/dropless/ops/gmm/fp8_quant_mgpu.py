"""The 128x128 weight quantizer in Pallas Mosaic GPU (Hopper).

Legend: G groups, K x N the weight dims, Kb = K / 128, Nb = N / 128.

  w [G, K, N] -> codes [G, K, N] E4M3, codes [G, N, K] E4M3 (optional), scales [G, Kb, Nb]

the same bits as ``ops.quant.quantize_blocks(w, (1, 128, 128))`` (tested, NaN,
infinite, zero and float32-subnormal blocks included) and as
``fp8_quant_kernels.quantize_weight`` (Pallas on Triton), but for the codes of a
block whose scale is NaN: the compiled Triton kernel writes -448 there (its
maximum ignores NaN on the GPU), this one NaN, as the model does. Dequantized,
both are NaN.

Why a second kernel: the model stores the layers' expert weights stacked
[L, G, K, N] and each layer quantizes its slice ``w[l]``. XLA reads such a slice
in place for a typed-FFI custom call, as Mosaic GPU's are (its dynamic-slice
fusion; seen for the Mosaic GEMMs in the bf16 step), but copies it out first for
a Triton call: on the H200 those copies took 3.95 ms of a 351 ms FP8 step
(``benchmarks/notes/fp8_hlo.md``, Q2; ``benchmarks/fp8_weight_slice.py`` checks
which happens for each kernel). It is also the first quantizer off Pallas's
Triton backend, which jax 0.11.2 deprecates.

Design: one CTA (one warpgroup, lane semantics) per (group, 128-row band of
K); it walks the band's Nb tiles with ``plgpu.emit_pipeline``, TMA loads
``max_concurrent_steps`` tiles ahead and asynchronous TMA stores of the codes
from ``out_slots`` smem buffers, so w is read once and each output written once.

- The bf16 tile lands in swizzled smem and is read into registers in the WGMMA
  layout (ldmatrix). Mosaic GPU reduces such a tiled array one axis at a time,
  so the block's amax is a max over columns, then over rows.
- NaN becomes +inf before the max (``quant._tensor_amax``'s rule), so the
  result does not depend on whether a max propagates NaN; a non-finite amax
  gives the NaN scale either way.
- The transposed codes come from reading the same smem tile through its
  transpose (``w_smem.T``, a transposing ldmatrix) and scaling it again: two
  smem reads and twice the arithmetic per tile, no extra global traffic.
  Mosaic GPU has no register transpose, and storing the codes through a
  transposed view of their smem tile does not lower (1-byte elements).
- The scale is stored as a scalar into global memory.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dropless.ops import quant
from dropless.ops.gmm.mosaic_gmm import vary_like

BLOCK = quant.BLOCKWISE_TILE  # 128
E4M3 = quant.E4M3


def _swizzle_transforms(dtype):
    """Swizzled smem for a tile with 128-element rows (what the WGMMA-layout loads need
    to be free of bank conflicts; TMA writes and reads it)."""
    swizzle = plgpu.find_swizzle(BLOCK * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _amax(x):
    """max |_read(x)| of a tile as float32, +inf where it holds a NaN or an infinity
    (``quant._tensor_amax``, reduced one axis at a time)."""
    a = jnp.abs(x)
    a = jnp.where(jnp.isnan(a), jnp.asarray(jnp.inf, a.dtype), a)
    amax = jnp.max(jnp.max(a, axis=1), axis=0).astype(jnp.float32)
    return jnp.where(amax < quant._F32_TINY, jnp.float32(0), amax)


def _codes(x, inv):
    """``quant._saturate(quant._read(x) * inv, E4M3)`` without the clamp, which never
    binds here: inv is the power of two that maps the block's amax to at most 448, and
    a product by a power of two is exact, so |x * inv| <= 448 (a NaN stays NaN either
    way). Two instructions per element fewer."""
    return (quant._read(x) * inv).astype(E4M3)


def check_operand(shape, dtype):
    """Raise ValueError unless w is [G, K, N] bfloat16 with K and N positive multiples of 128.

    (A float32 tile does not lower: Mosaic GPU has no transposed smem load for 4-byte
    elements in this layout.)
    """
    if len(shape) != 3 or any(s % BLOCK for s in shape[1:]) or 0 in shape:
        raise ValueError(f"fp8_quant_mgpu.quantize_weight: w must be [G, K, N] with K and N "
                         f"positive multiples of {BLOCK}, got {tuple(shape)}")
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(f"fp8_quant_mgpu.quantize_weight: w must be bfloat16, got {jnp.dtype(dtype)}")


@functools.partial(jax.jit, static_argnames=("transposed", "max_concurrent_steps", "out_slots"))
def quantize_weight(w_GKN, transposed=True, max_concurrent_steps=2, out_slots=1):
    """128x128 blocks of w [G, K, N] bf16 from one read: (wq [G, K, N] E4M3, wq as [G, N, K],
    sw [G, Kb, Nb] float32), or (wq, sw) when ``transposed`` is False.

    How the kernel runs, not what it returns (the same bits): ``max_concurrent_steps``
    w tiles in flight per CTA (32 KiB of smem each at bf16), ``out_slots`` tiles of
    codes whose stores may be in flight while the next is written (32 KiB each with
    the transposed codes, 16 without). The defaults take 96 KiB, so two CTAs share
    an SM.

    Off a GPU it runs only inside ``plgpu.force_gpu_interpret_mode``.

    Raises:
      ValueError: w not [G, K, N] bfloat16 with K and N positive multiples of 128;
        max_concurrent_steps or out_slots < 1.
    """
    check_operand(w_GKN.shape, w_GKN.dtype)
    if min(max_concurrent_steps, out_slots) < 1:
        raise ValueError(f"fp8_quant_mgpu.quantize_weight: {max_concurrent_steps=} and "
                         f"{out_slots=} must be >= 1")
    g, k, n = w_GKN.shape
    kb, nb = k // BLOCK, n // BLOCK
    out_type = [jax.ShapeDtypeStruct((g, k, n), E4M3)]
    if transposed:
        out_type.append(jax.ShapeDtypeStruct((g, n, k), E4M3))
    out_type.append(jax.ShapeDtypeStruct((g, kb, nb), jnp.float32))
    codes_smem = plgpu.SMEM((out_slots, BLOCK, BLOCK), E4M3, transforms=_swizzle_transforms(E4M3))

    def body(w_gmem, *out_gmem):
        *codes_gmem, s_gmem = out_gmem
        e, i = lax.axis_index("g"), lax.axis_index("k")

        def scoped(out_smem):
            def tile(idx, w_smem):
                (j,) = idx
                slot = j % out_slots
                x = plgpu.load(w_smem, layout=plgpu.Layout.WGMMA)
                scale, inv = quant.pow2_scale_parts(_amax(x), E4M3)
                s_gmem[e, i, j] = scale
                # The stores issued from this slot out_slots tiles ago must have read it.
                plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
                out_smem[0][slot] = _codes(x, inv)
                if transposed:
                    out_smem[1][slot] = _codes(plgpu.load(w_smem.T, layout=plgpu.Layout.WGMMA), inv)
                # Orders this tile's smem writes, and its reads of w_smem (which the
                # pipeline refills next, by TMA), before the asynchronous copies.
                plgpu.commit_smem()
                dst = [codes_gmem[0].at[e, pl.ds(i * BLOCK, BLOCK), pl.ds(j * BLOCK, BLOCK)]]
                if transposed:
                    dst.append(codes_gmem[1].at[e, pl.ds(j * BLOCK, BLOCK), pl.ds(i * BLOCK, BLOCK)])
                for c, (src, d) in enumerate(zip(out_smem, dst)):  # one group per tile
                    plgpu.copy_smem_to_gmem(src.at[slot], d, commit_group=c == len(dst) - 1)

            w_spec = plgpu.BlockSpec((BLOCK, BLOCK), lambda j: (i, j),
                                     transforms=_swizzle_transforms(w_GKN.dtype))
            plgpu.emit_pipeline(tile, grid=(nb,), in_specs=[w_spec],
                                max_concurrent_steps=max_concurrent_steps)(w_gmem.at[e])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, [codes_smem] * len(codes_gmem))

    out = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(g, kb),
        grid_names=("g", "k"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(w_GKN)
    return tuple(vary_like(o, (w_GKN,)) for o in out)
