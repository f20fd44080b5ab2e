"""The check that a tiny preset trains (``test_qwen3_tiny.py``, ``test_mixtral_tiny.py``)."""

import jax
import numpy as np

from dropless.train.loop import build


def assert_loss_falls(cfg, steps: int) -> None:
    """``steps`` steps of the loaded config ``cfg`` on its Markov data (Dirichlet 0.03
    rows over 256 tokens): every loss is finite, the mean of the first three is near
    ln 256 = 5.5 (above 5.0) and the mean of the last three at least 0.5 nats lower."""
    built = build(cfg.model(), cfg.train(), cfg.mesh())
    state, losses = built.state, []
    for _ in range(steps):
        state, metrics = built.step_fn(state, next(built.batches))
        losses.append(float(metrics["loss"]))
    jax.block_until_ready(state)
    assert np.all(np.isfinite(losses))
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert first > 5.0, losses  # near ln 256 at initialisation
    assert last < first - 0.5, losses
