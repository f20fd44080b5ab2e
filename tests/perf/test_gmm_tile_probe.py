"""benchmarks/gmm_tile_probe.py: the bf16 gmm's row-tile candidates run and lower.

Legend: M rows, K x N the weight dims (w [G, K, N]), G groups.

- ``--smoke`` (Pallas GPU interpret mode) runs the probe end to end on its tiny
  shape, and the tiling's output equals the float32 reference up to the bf16
  rounding of the output. The interpreter pays about 4-5 s per kernel on two cores
  (tracing, then a first call three times slower than the next), so the test
  takes one layout (Dirichlet(0.3): a 2-row group, boundary tiles at either
  block_m), the forward (dgrad is the same kernel with ``transpose_rhs``) and one
  tiling, about 6 s: 64 x 2*256 with 2 stages, which differs from the default
  tiling (tested in ``tests/ops/test_gmm_mosaic.py``) in every field but block_k
  and the walk. The full default smoke run (2 layouts, 5 tilings, both products:
  20 kernels, each output also compared bit for bit with the first tiling's)
  takes about 80 s.
- Each plain 64-row candidate's forward lowers for CUDA (Mosaic's layout
  inference and smem check run on the host) at the G=256 shape the probe is
  for, in 1-2 s.
  Not "table": on a CPU host it resolves to the default tiling, and the H200's
  entry there (128 x 2*128, chained) takes about 7 s to lower.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from dropless.ops.gmm import mosaic_gmm
from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]
probe = load_module("gmm_tile_probe", REPO / "benchmarks")

SMOKE_TILINGS = ["m64_n256_w8_s2"]
SMOKE_PRODUCTS = ["fwd"]  # dgrad is the same kernel (transpose_rhs): CI time
# Each output element is a float32 sum rounded once to bf16 (8 significant bits), so
# |out - y| <= 2^-8 |y| element by element and ||out - y|| / ||y|| <= 2^-8; float32
# summation order adds ~1e-6 against the HIGHEST-precision reference.
BF16_OUTPUT_TOL = 2.0**-8 * 1.01


def test_smoke_tiling_equals_the_reference(tmp_path):
    assert probe.main(["--smoke", "--layouts", "dirichlet0.3", "--out", str(tmp_path),
                       "--tilings", ",".join(SMOKE_TILINGS),
                       "--products", ",".join(SMOKE_PRODUCTS)]) == 0
    [record] = [json.loads(p.read_text()) for p in tmp_path.glob("gmm_tile_probe-*.json")]
    rows = record["rows"]
    assert [(r["product"], r["tiling"], r["layout"]) for r in rows] == [
        (product, tiling, "dirichlet0.3") for product in SMOKE_PRODUCTS for tiling in SMOKE_TILINGS]
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert r["rel_err_vs_reference"] <= BF16_OUTPUT_TOL, r


# The plain 64-row candidates; the 128-row tiles and the chain lower in
# tests/ops/test_gmm_mosaic.py.
@pytest.mark.parametrize("name", [name for name, tiling in probe.TILINGS.items()
                                  if tiling and tiling.block_m == 64 and not tiling.chain])
def test_candidate_lowers_for_cuda(name):
    """The probe's kernel (``mosaic.gmm`` calls it) at the H200's 132 SMs."""
    m, g, k, n = 65536, 256, 7168, 4096
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    tiling = probe.TILINGS[name]
    fn = lambda x, w, gs: mosaic_gmm.gmm(x, w, gs, tiling=tiling, sms=132)  # noqa: E731
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(
        s((m, k), bf), s((g, k, n), bf), s((g,), jnp.int32))
    assert "mosaic_gpu" in exported.mlir_module()
