"""The README example: ``MoEBlock`` inside a user's own small Flax NNX model.

The code between the markers plus the body of ``test_readme_usage`` is the
example shown in the README; the tests run it and check that training steps
lower the loss, that the optimizer leaves the ``RouterBias`` alone, and that
the train step's balancing update is what moves the bias.
"""

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dropless.config.sections import MoEConfig
from dropless.nn.moe import MoEBlock

# --- README example: begin (after the imports above) --------------------------

class TinyMoELM(nnx.Module):
    """Embedding -> one MoE block (residual) -> vocabulary head."""

    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.moe = MoEBlock(
            MoEConfig(
                num_experts=8, num_experts_per_tok=2, moe_mlp_dim=64, shared_experts=1,
                routed_score_func="sigmoid", routed_scaling_factor=2.5,
                n_routing_groups=4, topk_routing_group=2,            # DeepSeek-V3 routing
                routed_bias=True, routed_bias_update_rate=1e-3,      # aux-loss-free balancing
                seq_aux_loss_weight=1e-4,
            ),
            emb_dim=dim, rngs=rngs,
        )
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens_BS):
        h_BSD = self.embed(tokens_BS)
        y_BSD, stats = self.moe(h_BSD)
        return self.head(h_BSD + y_BSD), stats


@nnx.jit
def train_step(model, optimizer, tokens_BS):
    def loss_fn(model):
        logits, stats = model(tokens_BS[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BS[:, 1:]).mean()
        return ce + stats.aux_loss, stats

    (loss, stats), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    model.moe.update_router_bias(stats.tokens_per_expert)  # balancing: a state update, not a gradient
    return loss, stats


# --- README example: end (usage as in test_readme_usage) ----------------------


def test_readme_usage():
    model = TinyMoELM(vocab=64, dim=32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)  # RouterBias is not a Param
    tokens = jnp.tile(jnp.arange(17) % 64, (4, 1))  # a toy batch [B=4, S+1=17]
    loss, stats = train_step(model, optimizer, tokens)
    print(f"loss {loss:.3f}, tokens/expert {stats.tokens_per_expert}, "
          f"dropped {stats.dropped_tokens}")
    assert np.isfinite(float(loss))


def test_example_trains_and_balances():
    fresh = TinyMoELM(vocab=64, dim=32, rngs=nnx.Rngs(1))
    opt = nnx.Optimizer(fresh, optax.adamw(3e-3), wrt=nnx.Param)
    batch = jnp.asarray(np.random.default_rng().integers(0, 64, (4, 17)), jnp.int32)
    assert "router_bias" not in nnx.to_pure_dict(nnx.state(fresh, nnx.Param))["moe"]
    losses, bias = [], np.zeros(8, np.float32)
    for _ in range(8):
        before = np.asarray(fresh.moe.router_bias[...])
        loss, stats = train_step(fresh, opt, batch)
        losses.append(float(loss))
        # The bias moved by exactly the sign rule on the reported load, nothing else
        # (no optimizer step).
        load = np.asarray(stats.tokens_per_expert, np.float32)
        update = 1e-3 * np.sign(load.mean() - load)
        after = fresh.moe.router_bias[...]
        np.testing.assert_allclose(after, before + update, atol=1e-7)
        bias = bias + update
        assert int(stats.dropped_tokens) == 0
        assert int(stats.tokens_per_expert.sum()) == 4 * 16 * 2
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses
    assert np.any(bias != 0)
