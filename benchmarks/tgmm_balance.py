"""How evenly the wgrad kernel's tile orders spread work over the SMs: a NumPy model.

Legend: M rows, K x N the weight dims (dw [G, K, N]), G groups, S SMs, T tiles.

``mosaic_tgmm.tgmm`` runs one persistent CTA per SM over T = G * (K / 2 block_k)
* (N / block_n) output tiles. A tile of group g runs ``steps[g]`` pipeline
steps of block_m rows (``schedule.tgmm_steps``: from the group's first row
rounded down to block_m, so a group not starting on a block_m boundary pays
one step more), plus a fixed cost (pipeline fill, epilogue) the same for
every tile, plus an extra cost for each step that has to mask rows of a
neighbour group or past the total (first and last step of a group whose
bounds are not multiples of block_m). The assignment of tiles to SMs is
static, so the kernel ends when the most loaded SM does:

    time ~ max over SMs of the sum of its tiles' costs (in step units)

``imbalance`` = max / mean is the slowdown against a perfect spread of the
same work. Orders (``ORDERS``): ``groups`` (the kernel's default: tile i on
SM i mod S), ``sorted_snake`` (the kernel's other order: groups by descending
steps, rounds walked as a snake), and two halves of it the kernel does not
offer, to show what each half buys: ``snake`` and ``sorted``.

  PYTHONPATH=src python3 benchmarks/tgmm_balance.py          # the table for the notes
  PYTHONPATH=src python3 benchmarks/tgmm_balance.py --fit    # fit the costs to measured runs

Group sizes come from ``benchmarks/gmm.py``'s ``make_group_sizes`` with its
seed (``seed=G``), so the model sees the benchmark's exact layouts; tiles come
from the tuning table (``tuning_h200.json``) as the benchmark's do.
"""

import argparse
import functools
import itertools
import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np

from dropless.ops.gmm import schedule, tuning

BENCH_DIR = pathlib.Path(__file__).parent
ORDERS = ("groups", "snake", "sorted", "sorted_snake")
LAYOUTS = ("balanced", "dirichlet1.0", "dirichlet0.3", "empty")
SHAPES = {  # (M, G, K, N): DeepSeek-V3 at EP 8 and Qwen3-30B-A3B, as gmm.py's shape sets
    "deepseek": [(65536, 32, 7168, 4096), (65536, 32, 2048, 7168)],
    "qwen3-30b": [(65536, 128, 2048, 1536), (65536, 128, 768, 2048)],
}
H200_SMS = 132  # the records fitted here were measured on an H200


def group_steps(sizes_G, m, block_m):
    """[G] (steps, masked steps) of one tile of each group, as the kernel runs them."""
    starts_G, sizes_G = (np.asarray(a, np.int64)
                         for a in schedule.group_offsets(jnp.asarray(sizes_G), m))
    steps_G = schedule.tgmm_steps(starts_G, sizes_G, block_m)
    head_G = starts_G % block_m > 0  # the first step holds rows of the group before
    tail_G = (starts_G + sizes_G) % block_m > 0  # the last step holds rows after the end
    masked_G = np.where(steps_G == 1, head_G | tail_G, head_G.astype(int) + tail_G)
    return steps_G, np.where(sizes_G > 0, masked_G, 0)


def group_order(steps_G, order):
    """[G] groups in visiting order: index order, or by descending steps (stable)."""
    if order in ("sorted", "sorted_snake"):
        return np.argsort(-steps_G, kind="stable")
    return np.arange(len(steps_G))


def sm_loads(sizes_G, *, m, k, n, tiling, num_sms, tile_cost=2.0, mask_cost=0.0,
             order="groups"):
    """[S] work of each SM in step units under ``order``.

    A tile costs its group's steps + ``tile_cost`` + ``mask_cost`` per masked
    step; an empty group's tiles (a zero store) cost ``tile_cost``.

    Raises:
      ValueError: unknown order, or a tiling that does not divide K and N.
    """
    if order not in ORDERS:
        raise ValueError(f"{order=} is not one of {ORDERS}")
    if not tuning.fits(tiling, "wgrad", k, n):
        raise ValueError(f"{tiling} does not divide K={k}, N={n}")
    steps_G, masked_G = group_steps(sizes_G, m, tiling.block_m)
    cost_G = steps_G + tile_cost + mask_cost * masked_G
    tiles_per_group = (k // (2 * tiling.block_k)) * (n // tiling.block_n)
    cost_T = np.repeat(cost_G[group_order(steps_G, order)], tiles_per_group)
    num_tiles = cost_T.size
    waves = -(-num_tiles // num_sms)
    wave_W1, sm_1S = np.arange(waves)[:, None], np.arange(num_sms)[None, :]
    if order in ("snake", "sorted_snake"):
        t_WS = schedule.snake_tile(wave_W1, sm_1S, num_sms)
    else:  # nd_loop: round w hands tile w * S + s to SM s
        t_WS = wave_W1 * num_sms + sm_1S
    live = t_WS < num_tiles
    return np.bincount(np.broadcast_to(sm_1S, t_WS.shape)[live], weights=cost_T[t_WS[live]],
                       minlength=num_sms)


def wgrad_tiling(k, n):
    return tuning.lookup("wgrad", "bfloat16", k, n, gpu="h200")


def predict(shape, layout, *, order="groups", tile_cost=2.0, mask_cost=0.0,
            num_sms=H200_SMS):
    """(max/mean of the SM loads, predicted time relative to the balanced layout
    under the default order) for one gmm.py shape and layout."""
    gmm = _gmm_module()
    m, g, k, n = shape
    kw = dict(m=m, k=k, n=n, tiling=wgrad_tiling(k, n), num_sms=num_sms,
              tile_cost=tile_cost, mask_cost=mask_cost)
    loads = sm_loads(gmm.make_group_sizes(layout, m, g, seed=g), order=order, **kw)
    base = sm_loads(gmm.make_group_sizes("balanced", m, g, seed=g), **kw)
    return loads.max() / loads.mean(), loads.max() / base.max()


@functools.cache
def _gmm_module():
    from dropless.perf.bench import load_module

    return load_module("gmm", BENCH_DIR)


def measured_slowdowns(paths):
    """{(shape, layout): wgrad TF/s of the balanced layout / of this layout} from gmm records."""
    out = {}
    for path in paths:
        rows = json.loads(pathlib.Path(path).read_text())["results"]
        ours = {((r["M"], r["G"], r["K"], r["N"]), r["layout"]): r["tflops"]["ours"]["wgrad"]
                for r in rows if "wgrad" in r["tflops"].get("ours", {})}
        for (shape, layout), tf in ours.items():
            if layout != "balanced" and (shape, "balanced") in ours:
                out[(shape, layout)] = ours[(shape, "balanced")] / tf
    return out


def fit(measured, tile_costs, mask_costs):
    """(rms log error, tile_cost, mask_cost) of each pair, best first."""
    results = []
    for c, p in itertools.product(tile_costs, mask_costs):
        err = [np.log(predict(shape, layout, tile_cost=c, mask_cost=p)[1] / slow)
               for (shape, layout), slow in measured.items()]
        results.append((float(np.sqrt(np.mean(np.square(err)))), c, p))
    return sorted(results)


def print_table(costs):
    print("max/mean SM load (time vs balanced layout, default order) per tile order")
    for (c, p), (name, shapes) in itertools.product(costs, SHAPES.items()):
        print(f"tile_cost={c} mask_cost={p} ({name})")
        for shape, layout in itertools.product(shapes, LAYOUTS[1:]):
            cells = []
            for order in ORDERS:
                imb, rel = predict(shape, layout, order=order, tile_cost=c, mask_cost=p)
                cells.append(f"{order} {imb:.3f} ({rel:.3f})")
            print(f"  {shape} {layout:12s} " + " | ".join(cells))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", nargs="*", metavar="RECORD",
                   help="fit tile_cost and mask_cost to gmm records (default: the H200 ones)")
    p.add_argument("--costs", default="2:0,6:1.5", help="tile_cost:mask_cost pairs for the table")
    a = p.parse_args(argv)
    if a.fit is not None:
        paths = a.fit or sorted(BENCH_DIR.glob("results/gmm-*h200.json"))
        measured = measured_slowdowns(paths)
        if not measured:
            print("no skewed rows with a balanced partner in", [str(x) for x in paths])
            return 2
        best = fit(measured, [0, 1, 2, 3, 4, 6, 8], [0, 0.5, 1, 1.5, 2, 2.5, 3])
        print("rms log error, tile_cost, mask_cost (best 5):", best[:5])
        _, c, q = best[0]
        for (shape, layout), slow in sorted(measured.items()):
            imb, rel = predict(shape, layout, tile_cost=c, mask_cost=q)
            print(f"  {shape} {layout:12s} measured {slow:.3f} predicted {rel:.3f} "
                  f"(imbalance {imb:.3f})")
        return 0
    try:
        costs = [tuple(float(v) for v in pair.split(":")) for pair in a.costs.split(",")]
        if any(len(pair) != 2 for pair in costs):
            raise ValueError
    except ValueError:
        p.error(f"--costs {a.costs!r}: expected tile_cost:mask_cost pairs")
    print_table(costs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
