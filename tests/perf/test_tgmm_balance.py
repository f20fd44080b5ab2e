"""benchmarks/tgmm_balance.py: the per-SM load model of the wgrad kernel's tile orders.

Legend: G groups, S SMs; loads in pipeline steps.
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops.gmm import schedule
from dropless.ops.gmm.tuning import TgmmTiling
from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]
balance = load_module("tgmm_balance", REPO / "benchmarks")

# M = 264 rows in groups [10, 200, 54], block_m = 64:
#   group 0, rows [0, 10):    1 step, its end masked             -> 1 step, 1 masked
#   group 1, rows [10, 210):  steps from row 0 to 256, both ends -> 4 steps, 2 masked
#   group 2, rows [210, 264): steps from row 192 to 320          -> 2 steps, 2 masked
# K = N = 256 with 2 x 128 x 128 tiles: 2 tiles per group, 6 tiles.
# tile_cost 1, mask_cost 0.5: tiles cost 2.5 (group 0), 6 (group 1), 4 (group 2).
HAND = dict(m=264, k=256, n=256, tiling=TgmmTiling(), num_sms=4, tile_cost=1.0, mask_cost=0.5)
HAND_SIZES = np.array([10, 200, 54])


def test_group_steps_by_hand():
    steps, masked = balance.group_steps(HAND_SIZES, 264, 64)
    np.testing.assert_array_equal(steps, [1, 4, 2])
    np.testing.assert_array_equal(masked, [1, 2, 2])


@pytest.mark.parametrize("order, loads", [
    # flat costs [2.5, 2.5, 6, 6, 4, 4]; round 0 gives tiles 0-3 to SMs 0-3, round 1 tiles 4-5
    ("groups", [6.5, 6.5, 6, 6]),      # round 1 left to right: tiles 4, 5 on SMs 0, 1
    ("snake", [2.5, 2.5, 10, 10]),     # round 1 right to left: tiles 4, 5 on SMs 3, 2
    # groups by descending steps (1, 2, 0): flat costs [6, 6, 4, 4, 2.5, 2.5]
    ("sorted", [8.5, 8.5, 4, 4]),
    ("sorted_snake", [6, 6, 6.5, 6.5]),
])
def test_sm_loads_by_hand(order, loads):
    np.testing.assert_allclose(balance.sm_loads(HAND_SIZES, order=order, **HAND), loads)


def test_empty_groups_cost_the_fixed_part_only():
    loads = balance.sm_loads(np.array([0, 0]), **dict(HAND, num_sms=1))
    np.testing.assert_allclose(loads, [4 * HAND["tile_cost"]])


@pytest.mark.parametrize("order", balance.ORDERS)
def test_every_order_hands_out_all_the_work(order, rng):
    """Whatever the order, the loads sum to every tile's cost once."""
    sizes = rng.integers(0, 300, size=9)
    kw = dict(m=int(sizes.sum()) + 8, k=512, n=384, tiling=TgmmTiling(), num_sms=5,
              tile_cost=2.0, mask_cost=1.0)
    steps, masked = balance.group_steps(sizes, kw["m"], 64)
    total = np.sum((steps + 2.0 + masked) * 2 * 3)  # 2 K bands x 3 N tiles per group
    np.testing.assert_allclose(balance.sm_loads(sizes, order=order, **kw).sum(), total)


def test_model_sorts_groups_as_the_kernel_does(rng):
    """The model's "sorted" group order is the kernel's on-device order."""
    sizes = rng.integers(0, 200, size=16).astype(np.int32)
    sizes[3] = sizes[7] = 0  # ties
    m = int(sizes.sum()) + 40
    steps, _ = balance.group_steps(sizes, m, 64)
    np.testing.assert_array_equal(balance.group_order(steps, "sorted"),
                                  schedule.tgmm_group_order(jnp.asarray(sizes), m, 64))


def test_predict_uses_the_benchmark_layouts():
    """gmm.py's balanced layout at a G = 32 DeepSeek shape puts 2048 rows (32 steps)
    in every group: 32 x 28 x 32 = 28672 equal tiles on 132 SMs, 218 on the first
    28672 - 217 * 132 = 28 SMs and 217 on the others, so max/mean = 218 / (28672 / 132)."""
    imbalance, rel = balance.predict((65536, 32, 7168, 4096), "balanced", tile_cost=0.0)
    assert imbalance == pytest.approx(218 / (28672 / 132))
    assert rel == 1.0


def test_unknown_order_is_an_error():
    with pytest.raises(ValueError, match="order"):
        balance.sm_loads(HAND_SIZES, order="lpt", **HAND)
