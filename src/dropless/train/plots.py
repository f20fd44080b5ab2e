"""End-of-run PNG: loss curve against the data's entropy floor, and expert load.

Legend: L MoE layers, E routed experts.

Panels: (1) loss and LM loss per step, with the source's entropy rate as a
dashed floor when the data is Markov/synthetic; (2) when the model has MoE
layers, the share of routed token copies each expert received over the run,
per layer, relative to the balanced share 1/E (1.0 = perfectly balanced),
and the load coefficient of variation per step.
"""

import os

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _loss_panel(ax, rows, entropy_floor):
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], label="loss", lw=1.2)
    if any(r.get("mtp_loss") or r.get("aux_loss") for r in rows):
        ax.plot(steps, [r["lm_loss"] for r in rows], label="LM loss", lw=1.0, alpha=0.8)
    if entropy_floor is not None:
        ax.axhline(entropy_floor, color="k", ls="--", lw=1.0,
                   label=f"source entropy {entropy_floor:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend()


def _load_panels(fig, ax_heat, ax_cv, rows, load_LE):
    share_LE = load_LE / np.maximum(load_LE.sum(axis=-1, keepdims=True), 1) * load_LE.shape[-1]
    # Colour scale symmetric around balance, wide enough to show the worst expert.
    spread = max(0.05, float(np.abs(share_LE - 1.0).max()))
    im = ax_heat.imshow(share_LE, aspect="auto", cmap="coolwarm", vmin=1.0 - spread,
                        vmax=1.0 + spread, interpolation="nearest")
    num_layers, num_experts = share_LE.shape
    ax_heat.set_yticks(range(num_layers))
    if num_experts <= 32:
        ax_heat.set_xticks(range(num_experts))
    ax_heat.set_xlabel("expert")
    ax_heat.set_ylabel("MoE layer")
    ax_heat.set_title("expert load over the run (1 = balanced)")
    fig.colorbar(im, ax=ax_heat)
    cv_rows = [r for r in rows if "moe_load_cv" in r]
    ax_cv.plot([r["step"] for r in cv_rows], [r["moe_load_cv"] for r in cv_rows], lw=1.0)
    ax_cv.set_xlabel("step")
    ax_cv.set_ylabel("CV of tokens per expert")
    ax_cv.set_title("load imbalance per step (mean over layers)")
    ax_cv.grid(alpha=0.3)


def plot_run(rows: list[dict], path: str, *, entropy_floor: float | None = None,
             load_LE: np.ndarray | None = None, title: str = "") -> str:
    """Write the summary figure to ``path`` (PNG) and return the path.

    Args:
      rows: metrics rows (``metrics.make_row``), in step order.
      entropy_floor: nats/token the loss cannot go below, if known.
      load_LE: token copies per expert summed over the run, [L, E] (None: no MoE).
    """
    has_moe = load_LE is not None and np.size(load_LE) > 0
    fig, axes = plt.subplots(1, 3 if has_moe else 1, figsize=(16 if has_moe else 6, 4.5),
                             squeeze=False)
    _loss_panel(axes[0, 0], rows, entropy_floor)
    if has_moe:
        _load_panels(fig, axes[0, 1], axes[0, 2], rows, np.asarray(load_LE, np.float64))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
