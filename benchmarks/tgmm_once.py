"""Run the bf16 weight-gradient kernel a few times on one layout, for Nsight Compute.

Legend: M rows, K x N the weight dims (dw [G, K, N]), G groups.

``benchmarks/notes/gmm.md`` ("wgrad under skew") leaves about 10% of the
wgrad's loss under Dirichlet(0.3) at G=32 unexplained by masking and by the
per-SM step sums; its next suspect is the memory side (a few groups of
10-14k rows that every SM streams at once). This script gives ``ncu`` one
launch of ``mosaic.tgmm`` (the tuning table's tiling, the default tile order)
on ``gmm.py``'s group sizes for the layout (its generator and seed), after
warm-up launches, and times nothing itself (``ncu`` locks the clocks):

  ncu --set full -k regex:^tgmm --launch-skip 2 --launch-count 1 -o OUT/tgmm-dir03 \\
      python3 benchmarks/tgmm_once.py --layout dirichlet0.3
  ncu -i OUT/tgmm-dir03.ncu-rep --page raw > OUT/tgmm-dir03.txt

``--calls`` launches in all (default 3: two warm-up, then the profiled one).
``--smoke`` runs a tiny shape in Pallas GPU interpret mode on CPU.
"""

import argparse
import contextlib
import os
import pathlib

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dropless.ops.gmm import mosaic  # noqa: E402
from dropless.perf.bench import load_module  # noqa: E402

BENCH_DIR = pathlib.Path(__file__).parent
DEFAULT_SHAPE = (65536, 32, 7168, 4096)  # DeepSeek-V3's gate|up at G=32
SMOKE_SHAPE = (256, 2, 256, 256)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default=",".join(map(str, DEFAULT_SHAPE)), help="M,G,K,N")
    p.add_argument("--layout", default="dirichlet0.3")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shape, GPU interpret mode (CPU)")
    a = p.parse_args(argv)
    gmm = load_module("gmm", BENCH_DIR)
    if a.layout not in gmm.LAYOUTS:
        p.error(f"--layout {a.layout!r}: not one of {gmm.LAYOUTS}")
    try:
        m, g, k, n = (int(v) for v in a.shape.split(","))
    except ValueError:
        p.error(f"--shape {a.shape!r}: expected M,G,K,N")
    interpret = contextlib.nullcontext()
    if a.smoke:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        # a context, not ``set_gpu_interpret_mode``: a caller in the same process (the
        # tests) must not be left in interpret mode
        interpret = plgpu.force_gpu_interpret_mode()
        m, g, k, n = SMOKE_SHAPE
    x, _, dy = gmm.random_inputs(m, g, k, n, seed=m + g + k + n)
    sizes = gmm.make_group_sizes(a.layout, m, g, seed=g)
    fn = jax.jit(lambda x, dy, gs: mosaic.tgmm(x, dy, gs, num_groups=g))
    gs = jnp.asarray(sizes)
    with interpret:
        for _ in range(a.calls):
            dw = jax.block_until_ready(fn(x, dy, gs))
    print(f"M={m} G={g} K={k} N={n} {a.layout}: groups {int(sizes.min())}..{int(sizes.max())}, "
          f"{a.calls} calls, dw {dw.shape} {dw.dtype}")


if __name__ == "__main__":
    main()
