"""Host-side policy for expert-parallel receive-buffer overflow.

Legend: L MoE layers (all stacks and MTP, in ``moe_stats_concat`` order).

On device, every MoE layer counts the token rows its exchange could not
compute (``MoEStats.overflow_tokens``) and the train step skips the update of
any step with a nonzero count, so no step ever trains on dropped tokens.
Here the host looks at those counters: ``OverflowMonitor.record`` takes each
step's per-layer counts (the trainer fetches its metrics every step anyway)
and every ``ep_overflow_check_every_n_steps`` steps, and at the end of a run,
``check`` applies ``ep_overflow_policy``:

* ``error``: raise ``EPOverflowError`` naming each overflowing layer, how many
  token rows overflowed, the ``ragged_buffer_factor`` that would have
  sufficed, and the ``ep_overflow_rounds`` that would have delivered the same
  load through the configured buffers;
* ``warn``: print the same message and go on (those steps stay skipped).
"""

import math
from typing import Callable, Sequence

import numpy as np

POLICIES = ("error", "warn")


class EPOverflowError(RuntimeError):
    """Expert-parallel receive buffers overflowed and the policy is "error"."""


def sufficient_factor(needed: float) -> float:
    """``needed`` rounded up to two decimals, at least 1 (a factor the config accepts)."""
    return max(1.0, math.ceil(needed * 100 - 1e-6) / 100)


def sufficient_rounds(needed: float, buffer_factor: float) -> int:
    """Extra rounds that carry a load of ``needed`` x balanced through buffers of
    ``buffer_factor`` x balanced: each round moves one buffer's worth of rows,
    and its expert copies fit in as many windows (``parallel.ep``)."""
    return max(1, math.ceil(needed / buffer_factor - 1e-9) - 1)


class OverflowMonitor:
    """Collects per-layer overflow counters and applies the policy every N steps.

    Args:
      every_n_steps: steps between checks (``ep_overflow_check_every_n_steps``).
      policy: "error" | "warn" (``ep_overflow_policy``).
      buffer_factor: the configured ``ragged_buffer_factor`` (for the message).
      layer_names: one name per MoE layer row (``nn.model.moe_layer_names``).
      warn: where "warn" messages go (e.g. a console's print).

    Raises:
      ValueError: unknown policy or every_n_steps < 1.
    """

    def __init__(self, *, every_n_steps: int, policy: str, buffer_factor: float,
                 layer_names: Sequence[str], warn: Callable[[str], None] = print):
        if policy not in POLICIES:
            raise ValueError(f"ep_overflow_policy={policy!r} is not one of {POLICIES}")
        if every_n_steps < 1:
            raise ValueError(f"ep_overflow_check_every_n_steps={every_n_steps} must be >= 1")
        self.every_n_steps = every_n_steps
        self.policy = policy
        self.buffer_factor = buffer_factor
        self.layer_names = list(layer_names)
        self.warn = warn
        self.total_overflow_steps = 0
        self._reset()

    def _reset(self):
        n = len(self.layer_names)
        self._tokens_L = np.zeros(n, np.int64)
        self._needed_L = np.zeros(n, np.float64)
        self._steps: list[int] = []
        self._first = None

    def record(self, step: int, overflow_L, factor_needed_L) -> None:
        """Add one step's counters ([L] each); check when ``step`` is a multiple of N.

        Raises:
          EPOverflowError: at a check, with policy "error" and overflow seen.
        """
        overflow_L = np.asarray(overflow_L, np.int64).reshape(-1)
        if self._first is None:
            self._first = step
        if overflow_L.any():
            self._steps.append(step)
            self._tokens_L += overflow_L
            needed = np.asarray(factor_needed_L, np.float64).reshape(-1)
            self._needed_L = np.maximum(self._needed_L, np.where(overflow_L > 0, needed, 0))
        if step % self.every_n_steps == 0:
            self.check(step)

    def message(self, last_step: int) -> str | None:
        """The report of the overflow seen since the last check, or None if there was none."""
        if not self._steps:
            return None
        layers = "; ".join(
            f"{name}: {int(t)} token rows (needs factor {needed:.3g})"
            for name, t, needed in zip(self.layer_names, self._tokens_L, self._needed_L) if t
        )
        suffice = sufficient_factor(float(self._needed_L.max()))
        return (
            f"expert-parallel receive buffer overflow in {len(self._steps)} of steps "
            f"{self._first}-{last_step} (step {', '.join(map(str, self._steps[:5]))}"
            f"{', ...' if len(self._steps) > 5 else ''}); these steps were skipped, parameters "
            f"untouched. Overflowing layers: {layers}. ragged_buffer_factor="
            f"{self.buffer_factor:g} is too small: {suffice:g} would have sufficed for these "
            f"steps (ragged_buffer_factor=-1 sizes the buffers for the exact worst case), or "
            f"ep_overflow_rounds={sufficient_rounds(float(self._needed_L.max()), self.buffer_factor)}"
            f" would have delivered the overflow in extra exchange rounds with these buffers."
        )

    def check(self, step: int) -> None:
        """Apply the policy to what was recorded since the last check, then start afresh.

        Raises:
          EPOverflowError: policy "error" and overflow seen.
        """
        msg = self.message(step)
        self.total_overflow_steps += len(self._steps)
        self._reset()
        if msg is None:
            return
        if self.policy == "error":
            raise EPOverflowError(msg + " Set ep_overflow_policy=warn to continue past it.")
        self.warn(f"warning: {msg}")
