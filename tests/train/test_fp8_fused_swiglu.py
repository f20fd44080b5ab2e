"""``gmm_fp8_fused_swiglu: true`` reaches every MoE layer's down projection.

The FP8 kernels are their float32 references here (as in ``test_fp8_weight_codes``),
the quantizers XLA's; the fused path's numerics against the unfused one, bit for bit,
are ``tests/ops/test_gmm_swiglu_fp8.py``'s. This checks the plumbing: with the key on,
each MoE layer's down projection takes gate|up (``quantized.gmm(prologue="swiglu")``)
and quantizes SwiGLU's output in its own pass, forward (1x128) and backward (128x1),
also with the weights' codes made once per step; with it off, nothing does.
"""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from dropless.config.sections import DataConfig
from dropless.ops.gmm import quantized
from dropless.train import data as data_lib
from dropless.train import step as step_lib

slow = pytest.mark.slow  # skipped unless DROPLESS_SLOW=1 (tests/conftest.py)


@pytest.mark.parametrize("fused,once", [(False, False), pytest.param(True, False, marks=slow),
                                       (True, True)])
def test_fused_swiglu_reaches_each_moe_layer(small_model, monkeypatch, fp8_kernels_as_references,
                                             fused, once):
    layouts = []
    real = quantized._swiglu_codes
    monkeypatch.setattr(quantized, "_swiglu_codes",
                        lambda q, gu, layout: layouts.append((gu.shape[1], layout)) or real(q, gu, layout))
    moe = dataclasses.replace(small_model.moe, gmm_quantization="te_fp8_blockwise",
                              gmm_fp8_impl="kernel", gmm_fp8_quantizer="xla", moe_mlp_dim=256,
                              gmm_fp8_fused_swiglu=fused, gmm_fp8_weights_once_per_step=once)
    cfg = dataclasses.replace(small_model, emb_dim=256, mlp_dim=256, moe=moe)
    graphdef, init = step_lib.init_state_fn(cfg, optax.identity(), 0)
    state = jax.jit(init)()
    batch = data_lib.make_source(DataConfig(data_seed=1), cfg.vocab_size,
                                 batch=2, seq=16, accum=2 if once else 1).batch_at(0)
    loss, _, grads = jax.jit(lambda s, b: step_lib._grads(s, b, graphdef, cfg))(state, batch)
    assert np.isfinite(float(loss))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))
    # Traced once per layer body (the layers run in a scan): forward rows, backward columns.
    assert sorted(set(layouts)) == ([(512, "columns"), (512, "rows")] if fused else [])
