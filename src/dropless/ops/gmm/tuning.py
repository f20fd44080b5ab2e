"""Tile configurations for the Mosaic GPU grouped matmul kernels.

A checked-in table (``tuning_<gpu>.json`` beside this file, written by
``benchmarks/gmm.py --tune``) maps ``(gpu, dtype, kind, K, N)`` to a tiling;
a normal run only reads it. K and N are always the weight's dims
(``w[G, K, N]``), whatever the kind:

- ``fwd``:   y[M, N] = x[M, K] @ w[g]      (contraction K, output columns N)
- ``dgrad``: dx[M, K] = dy[M, N] @ w[g]^T  (contraction N, output columns K)
- ``wgrad``: dw[g][K, N] = x^T @ dy         (contraction over the group's rows)

A shape not in the table gets ``default_tiling``: the largest standard tile
that divides the shape. ``supports`` in ``mosaic.py`` admits only shapes for
which such a tile exists, so lookups never fail for admitted shapes.
"""

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp

KINDS = ("fwd", "dgrad", "wgrad")
_TABLE_DIR = pathlib.Path(__file__).parent


@dataclasses.dataclass(frozen=True)
class GmmTiling:
    """Forward / dgrad tile: a CTA computes block_m rows x (2 * block_n) columns.

    Two compute warpgroups each own a block_m x block_n f32 accumulator (128x128
    is 128 registers per thread); a third warpgroup issues the TMA loads.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    # Consecutive row tiles walked per column band before moving right: a band
    # keeps the same weight columns hot in L2 (see planar_snake).
    grid_tile_width: int = 1
    # Each CTA's tile pipelines as one chain, the next tile's loads overlapping this
    # one's end (``mosaic_gmm.walk_row_tiles``); the same bits. Taken where the
    # contraction's steps (K / block_k) are a multiple of the stages the call runs
    # with (one fewer for 4-byte outputs), else the plain walk. The H200's tune picked
    # it at DeepSeek-V3's K=7168 N=4096 (fwd 796 TF/s against 795, dgrad 784 against
    # 763 at G=32; ``tuning_h200.json``); off in ``default_tiling``, where it is
    # unmeasured.
    chain: bool = False

    def __post_init__(self):
        if self.block_m % 64 or self.block_n % 64 or self.block_k % 64:
            raise ValueError(f"{self}: block_m, block_n and block_k must be multiples of 64")
        if self.num_stages < 2:
            raise ValueError(f"{self}: num_stages must be >= 2")


@dataclasses.dataclass(frozen=True)
class TgmmTiling:
    """Wgrad tile: a CTA computes (2 * block_k) rows of dw[g] x block_n columns.

    Each compute warpgroup owns block_k rows of K; a pipeline step contracts
    block_m rows of the group.
    """

    block_k: int = 128
    block_n: int = 128
    block_m: int = 64
    num_stages: int = 4
    # One pipeline over all of a CTA's tiles, the next tile's loads overlapping this
    # one's end (``mosaic_gmm.chained_tile_pipeline``); same bits. On the H200 at
    # K=7168 N=4096 it ran 785 TF/s against 766 at G=32 and 548 against 510 at G=256
    # (``benchmarks/gmm.py --tune``, same runs), so ``default_tiling`` takes it.
    # Table entries written before it existed keep it off, as they were measured.
    chain: bool = False

    def __post_init__(self):
        if self.block_k % 64 or self.block_n % 64 or self.block_m % 64:
            raise ValueError(f"{self}: block_k, block_n and block_m must be multiples of 64")
        if self.num_stages < 2:
            raise ValueError(f"{self}: num_stages must be >= 2")


def tiling_cls(kind):
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    return TgmmTiling if kind == "wgrad" else GmmTiling


def gpu_name(device=None):
    """Short lower-case GPU name for table keys, e.g. 'h200' for 'NVIDIA H200'."""
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "") or ""
    name = kind.lower().replace("nvidia", "").strip().split(" ")[0] if kind else ""
    return name or "unknown"


def _out_and_contraction(kind, k, n):
    return {"fwd": (n, k), "dgrad": (k, n), "wgrad": (n, k)}[kind]


def fits(tiling, kind, k, n):
    """True when ``tiling`` divides the (K, N) problem of ``kind``."""
    if kind == "wgrad":
        return k % (2 * tiling.block_k) == 0 and n % tiling.block_n == 0
    out_cols, contraction = _out_and_contraction(kind, k, n)
    return out_cols % (2 * tiling.block_n) == 0 and contraction % tiling.block_k == 0


def default_tiling(kind, k, n):
    """Fallback rule: 128-wide warpgroup tiles when they divide, else 64-wide; the
    wgrad chained (``TgmmTiling.chain``); fwd and dgrad in bands of 8 row tiles
    (``GmmTiling.grid_tile_width``).

    Bands of 8: every H200 tune so far ran fwd and dgrad faster with 8 row tiles per
    column band than with 1, by 1.8-46% (9 of 10 comparisons; dgrad at K=768 N=2048
    631 against 634 TF/s), and no table entry kept 1 for the forward
    (``gmm-qwen3-30b-tune-20261203-0547``, ``gmm-deepseek-tune-chain-20261203-1306``,
    ``gmm-deepseek-g256-tune-chain-20261203-1323``). With 1, the CTAs in flight cover
    about one row tile across every column band, so a wide output re-reads the whole
    expert weight from HBM for each row tile: Mixtral-8x7B's forward (K=4096, N=28672,
    235 MB of weight per expert), on the untuned default, ran at 0.80x dense cuBLAS
    where its dgrad ran at 1.01x (``gmm-mixtral-8x7b-20261204-213629``).

    Returns None when no standard tile divides the shape (K or N not a
    multiple of 128).
    """
    cls = tiling_cls(kind)
    for width in (128, 64):
        tiling = (cls(block_k=width, chain=True) if kind == "wgrad"
                  else cls(block_n=width, grid_tile_width=8))
        if fits(tiling, kind, k, n):
            return tiling
        if kind == "wgrad":
            tiling = cls(block_k=width, block_n=64, chain=True)
            if fits(tiling, kind, k, n):
                return tiling
    return None


@functools.cache
def load_table(gpu):
    """{(dtype, kind, K, N): tiling} from ``tuning_<gpu>.json`` (empty if absent)."""
    path = _TABLE_DIR / f"tuning_{gpu}.json"
    if not path.exists():
        return {}
    entries = json.loads(path.read_text())["entries"]
    table = {}
    for e in entries:
        key = (e["dtype"], e["kind"], int(e["k"]), int(e["n"]))
        table[key] = tiling_cls(e["kind"])(**e["tiling"])
    return table


def lookup(kind, dtype, k, n, *, gpu=None):
    """Tiling for one problem: the table's entry, else ``default_tiling``.

    Raises:
      ValueError if no tile divides the shape.
    """
    gpu = gpu or gpu_name()
    tiling = load_table(gpu).get((jnp.dtype(dtype).name, kind, int(k), int(n)))
    if tiling is not None and fits(tiling, kind, k, n):
        return tiling
    tiling = default_tiling(kind, k, n)
    if tiling is None:
        raise ValueError(
            f"mosaic gmm: no tile fits {kind} with K={k}, N={n}; "
            "K and N must be multiples of 128"
        )
    return tiling
