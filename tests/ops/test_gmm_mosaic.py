"""Mosaic GPU gmm kernels against the reference backend.

Legend: M rows, K x N the weight dims (w[G, K, N]), G groups.

Three levels:
- CPU, always: the kernels lower for CUDA through ``jax.export`` (Mosaic's
  layout inference and smem checks run on the host).
- CPU, always: the kernels run in Pallas GPU interpret mode on small awkward
  layouts (outputs start as NaN there, so an unwritten element fails).
- GPU (marker ``gpu``, skipped unless a Hopper GPU is the default device):
  fwd, dgrad, wgrad and the full custom_vjp gradient on fresh random bf16
  inputs for empty groups, groups smaller than a tile, one group holding all
  rows, ``sum(group_sizes) < M`` and M not a multiple of the tile. Rows of x
  and dy past the total are NaN and must not leak; rows of the outputs past
  the total must be exact zeros; relative error ||out - ref|| / ||ref|| is
  checked per group.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops.gmm import api, mosaic, mosaic_gmm, mosaic_tgmm, reference
from dropless.ops.gmm.tuning import GmmTiling, TgmmTiling

hopper = pytest.mark.skipif(not mosaic.is_available(), reason="needs a Hopper (sm_90) GPU")
BF16_TOL = 1e-2


def layout_sizes(layout, m, g, rng):
    """Group sizes for one awkward layout; sum <= m."""
    if layout == "random_with_empty":
        p = rng.dirichlet(np.full(g, 0.5))
        sizes = np.floor(p * m).astype(np.int64)
        sizes[rng.choice(g, size=max(1, g // 3), replace=False)] = 0
        return sizes.astype(np.int32)  # total < m: a tail of rows past the end
    if layout == "one_group":
        sizes = np.zeros(g, np.int32)
        sizes[rng.integers(g)] = m
        return sizes
    if layout == "tiny_groups":  # groups shorter than a tile, then a long one
        sizes = rng.integers(0, 40, size=g).astype(np.int32)
        sizes[-1] = m - sizes[:-1].sum()
        return sizes
    if layout == "all_empty":
        return np.zeros(g, np.int32)
    raise ValueError(layout)


def problem(rng, m, k, n, g, sizes, dtype=jnp.bfloat16):
    """bf16 x, w, dy with rows of x and dy past the total set to NaN."""
    total = int(sizes.sum())
    x = rng.standard_normal((m, k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    x[total:] = np.nan
    dy[total:] = np.nan
    w = (rng.standard_normal((g, k, n)) / np.sqrt(k)).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(dy, dtype)


def assert_rows_match(out, ref, sizes):
    """Per-group relative error on the group's rows; exact zeros past the total."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert not np.isnan(out).any(), "NaN in output (unwritten element or leaked NaN)"
    start = 0
    for size in sizes:
        if size:
            o, r = out[start:start + size], ref[start:start + size]
            assert np.linalg.norm(o - r) <= BF16_TOL * np.linalg.norm(r), (start, size)
        start += size
    np.testing.assert_array_equal(out[start:], 0.0)


def assert_groups_match(dw, ref, sizes):
    dw = np.asarray(dw, np.float64)
    ref = np.asarray(ref, np.float64)
    assert not np.isnan(dw).any()
    for e, size in enumerate(sizes):
        if size == 0:
            np.testing.assert_array_equal(dw[e], 0.0)
        else:
            assert np.linalg.norm(dw[e] - ref[e]) <= BF16_TOL * np.linalg.norm(ref[e]), e


def clean(a):
    return jnp.nan_to_num(a)


# ---------------------------------------------------------------- CPU: lowering


@pytest.mark.parametrize("kind", ["fwd", "dgrad", "wgrad"])
def test_kernels_lower_for_cuda(kind):
    m, k, n, g = 4096, 512, 768, 40  # w is [G, K, N]
    s = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    w = s((g, k, n), bf)
    gs = s((g,), jnp.int32)
    if kind == "fwd":
        fn = lambda x, w, gs: mosaic_gmm.gmm(x, w, gs, tiling=GmmTiling(), sms=132)
        args = (s((m, k), bf), w, gs)
    elif kind == "dgrad":
        fn = lambda dy, w, gs: mosaic_gmm.gmm(dy, w, gs, tiling=GmmTiling(), transpose_rhs=True, sms=132)
        args = (s((m, n), bf), w, gs)
    else:
        fn = lambda x, dy, gs: mosaic_tgmm.tgmm(x, dy, gs, num_groups=g, tiling=TgmmTiling(), sms=132)
        args = (s((m, k), bf), s((m, n), bf), gs)
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("shape", [(65536, 7168, 4096, 32), (65536, 7168, 4096, 256)], ids=str)
def test_wgrad_chain_lowers_for_cuda(shape):
    """``TgmmTiling(chain=True)`` at DeepSeek-V3's gate/up shape, G=32 and G=256."""
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    m, k, n, g = shape
    fn = lambda x, dy, gs: mosaic_tgmm.tgmm(x, dy, gs, num_groups=g,  # noqa: E731
                                            tiling=TgmmTiling(chain=True), sms=132)
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(
        s((m, k), bf), s((m, n), bf), s((g,), jnp.int32))
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("transpose", [False, True], ids=["fwd", "dgrad"])
def test_chain_lowers_for_cuda(transpose):
    """``GmmTiling(chain=True)`` at DeepSeek-V3's down projection (32 / 112 steps)."""
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    m, k, n, g = 65536, 2048, 7168, 32
    a = s((m, n if transpose else k), bf)
    fn = lambda a, w, gs: mosaic_gmm.gmm(a, w, gs, tiling=GmmTiling(chain=True),  # noqa: E731
                                         transpose_rhs=transpose, sms=132)
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(a, s((g, k, n), bf),
                                                                  s((g,), jnp.int32))
    assert "mosaic_gpu" in exported.mlir_module()


def test_groups_tile_order_lowers_for_cuda():
    """The round robin (``tile_order="groups"``; the default ``"sorted_snake"``, its
    on-device group order and snake loop lower in ``test_kernels_lower_for_cuda``)
    lowers, here through the backend entry with rows and K, N that need padding (the
    option reaches the kernel); an unknown order is refused."""
    m, k, n, g = 4100, 2000, 768, 40
    s = jax.ShapeDtypeStruct
    x, dy, gs = s((m, k), jnp.bfloat16), s((m, n), jnp.bfloat16), s((g,), jnp.int32)
    fn = lambda x, dy, gs: mosaic.tgmm(x, dy, gs, num_groups=g, tile_order="groups")
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(x, dy, gs)
    assert "mosaic_gpu" in exported.mlir_module()
    with pytest.raises(ValueError, match="tile_order"):
        jax.eval_shape(lambda x, dy, gs: mosaic.tgmm(x, dy, gs, num_groups=g, tile_order="lpt"),
                       x, dy, gs)


def test_rows_not_a_multiple_of_8_lower_through_padding():
    """The kernels' swizzled TMA views tile rows in 8s; the backend entry pads."""
    m, k, n, g = 4100, 384, 640, 33
    s = jax.ShapeDtypeStruct
    x, dy, w = s((m, k), jnp.bfloat16), s((m, n), jnp.bfloat16), s((g, k, n), jnp.bfloat16)
    gs = s((g,), jnp.int32)
    for fn, args in [
        (lambda x, w, gs: mosaic.gmm(x, w, gs), (x, w, gs)),
        (lambda dy, w, gs: mosaic.gmm(dy, w, gs, transpose_rhs=True), (dy, w, gs)),
        (lambda x, dy, gs: mosaic.tgmm(x, dy, gs, num_groups=g), (x, dy, gs)),
    ]:
        jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    with pytest.raises(ValueError, match="multiple of 8"):
        jax.eval_shape(lambda x, w, gs: mosaic_gmm.gmm(x, w, gs, tiling=GmmTiling(block_n=64)), x, w, gs)


def test_unaligned_k_n_lower_through_padding():
    """K and N that no tile divides lower to the kernels on padded operands."""
    m, k, n, g = 4096, 2000, 1400, 16  # neither a multiple of 128
    s = jax.ShapeDtypeStruct
    x, dy, w = s((m, k), jnp.bfloat16), s((m, n), jnp.bfloat16), s((g, k, n), jnp.bfloat16)
    gs = s((g,), jnp.int32)
    for fn, args, shape in [
        (lambda x, w, gs: mosaic.gmm(x, w, gs), (x, w, gs), (m, n)),
        (lambda dy, w, gs: mosaic.gmm(dy, w, gs, transpose_rhs=True), (dy, w, gs), (m, k)),
        (lambda x, dy, gs: mosaic.tgmm(x, dy, gs, num_groups=g), (x, dy, gs), (g, k, n)),
    ]:
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
        assert "mosaic_gpu" in exported.mlir_module()
        assert exported.out_avals[0].shape == shape


# ------------------------------------------------------ CPU: interpret mode


def _interpret(detect_races=False):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=detect_races))


def _races_found():
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    return get_races().races_found


def test_interpret_fwd_and_dgrad_awkward_layout(rng):
    """Row-exact (boundary) tiles next to whole tiles, 64-wide warpgroup tiles, a tail.

    The race detector watches the epilogue buffers: a row-exact store by one
    warpgroup must never overlap a whole-tile store by the other.
    """
    m, k, n, g = 516, 128, 256, 6  # M = 516: the entry pads rows to 520
    sizes = np.array([70, 0, 330, 10, 40, 0], np.int32)  # 10-row group, tail of 66 rows
    x, w, dy = problem(rng, m, k, n, g, sizes)
    gs = jnp.asarray(sizes)
    with _interpret(detect_races=True):
        y = mosaic.gmm(x, w, gs, tiling=GmmTiling(block_n=64, grid_tile_width=2))
        dx = mosaic.gmm(dy, w, gs, tiling=GmmTiling(block_n=64), transpose_rhs=True)
    assert not _races_found()
    assert_rows_match(y, reference.gmm(clean(x), w, gs), sizes)
    assert_rows_match(dx, reference.gmm(clean(dy), w, gs, transpose_rhs=True), sizes)


@pytest.mark.parametrize("direction,ctas", [("fwd", (1, 7)), ("dgrad", (7,)),
                                            pytest.param("dgrad", (1,), marks=pytest.mark.slow)])
def test_interpret_fwd_and_dgrad_chain_equal_the_plain_walk_bit_for_bit(rng, direction, ctas):
    """``GmmTiling(chain=True)``: each CTA's tile pipelines as one chain, the zero tiles
    past the total in a loop of their own (``mosaic_gmm.walk_row_tiles``). The same
    products, so the same bits as the plain walk (whose bits do not depend on the CTA
    count): one CTA's chain of every tile, and seven CTAs' chains of one and of two
    (block_k 64: 2 steps along K = 128, 4 along N = 256; two stages). The dgrad's
    one-CTA chain, a further case of an opt-in tiling, is ``slow`` (CI time)."""
    m, k, n, g = 264, 128, 256, 6  # the kernel itself takes rows in 8s
    sizes = np.array([70, 0, 130, 10, 40, 0], np.int32)  # a tail of 14 rows
    x, w, dy = problem(rng, m, k, n, g, sizes)
    gs = jnp.asarray(sizes)
    plain = GmmTiling(block_n=64, grid_tile_width=2, num_stages=2)
    chained = dataclasses.replace(plain, chain=True)
    a, transpose = (x, False) if direction == "fwd" else (dy, True)
    with _interpret():
        want = np.asarray(mosaic_gmm.gmm(a, w, gs, tiling=plain, transpose_rhs=transpose),
                          np.float32)
    for sms in ctas:
        with _interpret(detect_races=sms > 1):  # races need two CTAs
            got = mosaic_gmm.gmm(a, w, gs, tiling=chained, transpose_rhs=transpose, sms=sms)
            got = got.block_until_ready()
        assert not _races_found()
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.parametrize("sizes", [[1, 2, 3, 64, 65, 100, 0], [0, 0, 300, 0, 0, 0, 0]], ids=str)
def test_interpret_wgrad_masks_neighbour_and_nan_rows(rng, sizes):
    m, k, n = 300, 256, 128
    sizes = np.array(sizes, np.int32)
    x, _, dy = problem(rng, m, k, n, len(sizes), sizes)
    with _interpret():
        dw = mosaic.tgmm(x, dy, jnp.asarray(sizes), num_groups=len(sizes), tiling=TgmmTiling())
    ref = reference.tgmm(clean(x), clean(dy), jnp.asarray(sizes), num_groups=len(sizes))
    assert_groups_match(dw, ref, sizes)


@pytest.mark.parametrize("sizes", [[300, 3, 0, 64, 65, 100, 0, 1], [0] * 8], ids=str)
def test_interpret_wgrad_tile_orders_agree_bit_for_bit(rng, sizes):
    """Each output tile is computed whole by one CTA in the same steps whatever the
    order, so "sorted_snake" must equal "groups" exactly. 3 CTAs over 8 groups x
    2 N tiles: 6 rounds, the last partial, groups far from sorted, empty ones
    (zero stores), NaN rows past the total; the output starts as NaN in
    interpret mode, so a tile visited by no CTA fails too."""
    m, k, n = 560, 256, 256
    sizes = np.array(sizes, np.int32)
    x, _, dy = problem(rng, m, k, n, len(sizes), sizes)
    gs = jnp.asarray(sizes)
    run = lambda order: mosaic_tgmm.tgmm(x, dy, gs, num_groups=len(sizes), tiling=TgmmTiling(),
                                         sms=3, tile_order=order)
    with _interpret():
        by_groups, sorted_snake = run("groups"), run("sorted_snake")
    np.testing.assert_array_equal(np.asarray(sorted_snake, np.float32),
                                  np.asarray(by_groups, np.float32))
    ref = reference.tgmm(clean(x), clean(dy), gs, num_groups=len(sizes))
    assert_groups_match(sorted_snake, ref, sizes)


@pytest.mark.parametrize("order", ["groups"])  # "sorted_snake": the FP8 test
def test_interpret_wgrad_chain_equals_the_plain_kernel_bit_for_bit(rng, order):
    """``TgmmTiling(chain=True)``: one loop over all of a CTA's tiles' steps, slots and
    barrier phases running on from tile to tile, so each tile gets the plain
    kernel's steps, masks included, in the same order: its bits (race detector on).
    3 CTAs over 8 groups x 2 N tiles: 6 rounds, the last partial; groups that start
    and end inside a step (masked), empty ones, NaN rows past the total; 3 stages."""
    m, k, n = 560, 256, 256
    sizes = np.array([300, 3, 0, 64, 65, 100, 0, 1], np.int32)
    x, _, dy = problem(rng, m, k, n, len(sizes), sizes)
    gs = jnp.asarray(sizes)
    run = lambda chain: mosaic_tgmm.tgmm(  # noqa: E731
        x, dy, gs, num_groups=len(sizes), tiling=TgmmTiling(num_stages=3, chain=chain), sms=3,
        tile_order=order)
    with _interpret(detect_races=True):
        chained = run(True).block_until_ready()
        assert not _races_found()
    with _interpret():
        plain = run(False)
    np.testing.assert_array_equal(np.asarray(chained, np.float32), np.asarray(plain, np.float32))
    ref = reference.tgmm(clean(x), clean(dy), gs, num_groups=len(sizes))
    assert_groups_match(chained, ref, sizes)


@pytest.mark.parametrize("k, n", [(96, 160), (200, 128)], ids=str)
def test_interpret_unaligned_k_n_are_padded(rng, k, n):
    """K or N not a multiple of 128: zero-padded to the kernels' tiles, cut back, exact."""
    m = 150
    sizes = np.array([40, 0, 70, 20], np.int32)  # a tail of 20 rows
    x, w, dy = problem(rng, m, k, n, len(sizes), sizes)
    gs = jnp.asarray(sizes)
    with _interpret():
        y = mosaic.gmm(x, w, gs)
        dx = mosaic.gmm(dy, w, gs, transpose_rhs=True)
        dw = mosaic.tgmm(x, dy, gs, num_groups=len(sizes))
    assert y.shape == (m, n) and dx.shape == (m, k) and dw.shape == (len(sizes), k, n)
    assert_rows_match(y, reference.gmm(clean(x), w, gs), sizes)
    assert_rows_match(dx, reference.gmm(clean(dy), w, gs, transpose_rhs=True), sizes)
    assert_groups_match(dw, reference.tgmm(clean(x), clean(dy), gs, num_groups=len(sizes)),
                        sizes)


# ------------------------------------------------------------------- GPU

GPU_SHAPES = [(1000, 256, 512, 7), (4100, 384, 640, 33)]  # (M, K, N, G); M not a tile multiple
LAYOUTS = ["random_with_empty", "one_group", "tiny_groups", "all_empty"]


def _poison_allocator(*shapes):
    """Leave NaN in freed device memory, so an unwritten output element shows."""
    for shape in shapes:
        jnp.full(shape, jnp.nan, jnp.bfloat16).block_until_ready().delete()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_fwd_dgrad_wgrad_match_reference(shape, layout, rng):
    m, k, n, g = shape
    sizes = layout_sizes(layout, m, g, rng)
    x, w, dy = problem(rng, m, k, n, g, sizes)
    gs = jnp.asarray(sizes)
    _poison_allocator((m, n))
    assert_rows_match(mosaic.gmm(x, w, gs), reference.gmm(clean(x), w, gs), sizes)
    _poison_allocator((m, k))
    dx = mosaic.gmm(dy, w, gs, transpose_rhs=True)
    assert_rows_match(dx, reference.gmm(clean(dy), w, gs, transpose_rhs=True), sizes)
    _poison_allocator((g, k, n))
    dw = mosaic.tgmm(x, dy, gs, num_groups=g)
    assert_groups_match(dw, reference.tgmm(clean(x), clean(dy), gs, num_groups=g), sizes)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("g", [8, 64])
def test_gpu_wgrad_chain_equals_the_plain_kernel_bit_for_bit(rng, g):
    """``TgmmTiling(chain=True)`` on the hardware, where the memory warpgroup really runs
    ahead into the next tile's steps while the compute warpgroups store: the plain
    kernel's bits, with ragged groups (masked first and last steps) and empty ones;
    at G=64 tiles of a few steps each, where a tile's start costs most."""
    m, k, n = 8192, 1024, 1024
    sizes = layout_sizes("random_with_empty", m, g, rng)
    x, _, dy = problem(rng, m, k, n, g, sizes)
    gs = jnp.asarray(sizes)
    got = mosaic_tgmm.tgmm(x, dy, gs, num_groups=g, tiling=TgmmTiling(chain=True))
    want = mosaic_tgmm.tgmm(x, dy, gs, num_groups=g, tiling=TgmmTiling())
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("transpose", [False, True], ids=["fwd", "dgrad"])
def test_gpu_fwd_dgrad_chain_equals_the_plain_walk_bit_for_bit(rng, transpose):
    """``GmmTiling(chain=True)`` on the hardware, where the memory warpgroup really runs
    ahead into the next tile: the same bits as the plain walk (DeepSeek-V3's down
    projection: 32 steps along K = 2048 and 112 along N = 7168, four stages)."""
    m, k, n, g = 8192, 2048, 7168, 8
    sizes = layout_sizes("random_with_empty", m, g, rng)
    x, w, dy = problem(rng, m, k, n, g, sizes)
    gs = jnp.asarray(sizes)
    a = dy if transpose else x
    got = mosaic_gmm.gmm(a, w, gs, tiling=GmmTiling(chain=True), transpose_rhs=transpose)
    want = mosaic_gmm.gmm(a, w, gs, tiling=GmmTiling(), transpose_rhs=transpose)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
@hopper
def test_gpu_custom_vjp_matches_reference(rng):
    m, k, n, g = 2000, 256, 384, 9
    sizes = layout_sizes("random_with_empty", m, g, rng)
    x, w, dy = problem(rng, m, k, n, g, sizes)
    x, dy = clean(x), clean(dy)
    gs = jnp.asarray(sizes)

    def value_and_grads(backend):
        y, vjp = jax.vjp(lambda x, w: api.gmm(x, w, gs, backend=backend), x, w)
        return (y, *vjp(dy))

    y, dx, dw = jax.jit(lambda: value_and_grads("mosaic"))()
    y_ref, dx_ref, dw_ref = value_and_grads("reference")
    assert_rows_match(y, y_ref, sizes)
    assert_rows_match(dx, dx_ref, sizes)
    assert_groups_match(dw, dw_ref, sizes)
    assert api.resolve_backend("auto", x.shape, w.shape, x.dtype) == "mosaic"


@pytest.mark.gpu
@hopper
def test_gpu_fp16_and_f32_output(rng):
    m, k, n, g = 640, 128, 256, 4
    sizes = np.array([100, 0, 300, 200], np.int32)
    x, w, _ = problem(rng, m, k, n, g, sizes, dtype=jnp.float16)
    gs = jnp.asarray(sizes)
    y = mosaic.gmm(x, w, gs, out_dtype=jnp.float32)
    assert y.dtype == jnp.float32
    assert_rows_match(y, reference.gmm(clean(x), w, gs, out_dtype=jnp.float32), sizes)
