"""Under gradient accumulation the FP8 kernels' expert-weight codes are made once per step.

``gmm_fp8_weights_once_per_step: true`` (opt-in): with A > 1 microbatches the train
step quantizes each expert weight before the microbatch loop (``moe.fp8_weight_codes``)
and every microbatch's FP8 kernels read those codes (``quantized.gmm(w_codes=...)``)
instead of quantizing the same weight again. Quantization is deterministic, so the
loss and every gradient must equal the per-microbatch path's bit for bit.

On a CPU host the FP8 kernels cannot run, so here they are replaced by their float32
references (``mosaic_fp8.reference``, ``mosaic_fp8_tgmm.reference``: the kernels'
products of the same codes and scales), with XLA's quantizers; everything around them
(the quantizers, the custom VJPs, the model, the microbatch loop) is the real code.
The hardware run of the same comparison is ``tests/ops/test_gmm_mosaic_fp8.py``'s
``test_gpu_weight_codes_give_the_same_bits``.
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dropless.config.sections import DataConfig
from dropless.ops.gmm import quantized
from dropless.train import data as data_lib
from dropless.train import step as step_lib

slow = pytest.mark.slow  # skipped unless DROPLESS_SLOW=1 (tests/conftest.py)


@pytest.fixture
def kernels_as_references(monkeypatch, fp8_kernels_as_references):
    """The FP8 kernels as their float32 references, and a count of weight quantizations."""
    calls = []
    real = quantized.quantizer("xla")

    def weight_both(w):
        calls.append(w.shape)
        return real.weight_both(w)

    counting = real._replace(weight_both=weight_both)
    monkeypatch.setattr(quantized, "quantizer", lambda name: counting)
    return calls


def _config(small_model, once, scan_layers=True):
    # K and N multiples of 256 (the kernels' shapes): wi [E, 256, 512], wo [E, 256, 256].
    moe = dataclasses.replace(small_model.moe, gmm_quantization="te_fp8_blockwise",
                              gmm_fp8_impl="kernel", gmm_fp8_quantizer="xla", moe_mlp_dim=256,
                              gmm_fp8_weights_once_per_step=once)
    return dataclasses.replace(small_model, emb_dim=256, mlp_dim=256, moe=moe,
                               scan_layers=scan_layers)


def _codes(state, graphdef, cfg):
    return jax.eval_shape(lambda s: step_lib._fp8_codes_once(s, graphdef, cfg), state)


@pytest.mark.parametrize("scan_layers", [True, pytest.param(False, marks=slow)])
def test_weights_quantized_once_per_step_give_the_per_microbatch_bits(
        small_model, kernels_as_references, caplog, scan_layers):
    """The layers in a scan (each takes its slice of the stacked codes) and unrolled."""
    calls = kernels_as_references
    results = {}
    for once in (False, True):
        cfg = _config(small_model, once, scan_layers)
        graphdef, init = step_lib.init_state_fn(cfg, optax.identity(), 0)
        state = jax.jit(init)()
        batch = data_lib.make_source(DataConfig(data_seed=1), cfg.vocab_size,
                                     batch=2, seq=16, accum=2).batch_at(0)
        calls.clear()
        with caplog.at_level(logging.INFO, logger=step_lib._log.name):
            loss, aux, grads = jax.jit(lambda s, b: step_lib._grads(s, b, graphdef, cfg))(state, batch)
        results[once] = (loss, grads, list(calls))
    (loss0, grads0, calls0), (loss1, grads1, calls1) = results[False], results[True]
    # Once per step: one quantization per expert weight (the MoE stack's wi and wo,
    # [layers, E, K, N] quantized as one), none inside the microbatch loop.
    moe_layers = small_model.num_decoder_layers - small_model.first_num_dense_layers
    assert calls1 == [(moe_layers * 4, 256, 512), (moe_layers * 4, 256, 256)], calls1
    assert calls0 and all(shape[0] == 4 for shape in calls0)  # per layer, inside the loop
    assert "quantized once per optimizer step" in caplog.text
    np.testing.assert_array_equal(np.asarray(loss1), np.asarray(loss0))
    flat0 = dict(jax.tree_util.tree_flatten_with_path(grads0)[0])
    flat1 = dict(jax.tree_util.tree_flatten_with_path(grads1)[0])
    assert flat0.keys() == flat1.keys()
    for path, g in flat0.items():
        np.testing.assert_array_equal(np.asarray(flat1[path]), np.asarray(g),
                                      err_msg=jax.tree_util.keystr(path))
    # The expert weights did get gradients through the kernels' path.
    wi = [g for p, g in flat1.items() if jax.tree_util.keystr(p).endswith("['wi']")]
    assert wi and all(float(jnp.max(jnp.abs(g))) > 0 for g in wi)


def test_one_microbatch_quantizes_in_the_layer(small_model, kernels_as_references):
    """With A = 1 nothing changes: the layer quantizes its weights (no codes made outside)."""
    cfg = _config(small_model, True)
    graphdef, init = step_lib.init_state_fn(cfg, optax.identity(), 0)
    state = jax.eval_shape(init)
    assert _codes(state, graphdef, cfg) is not None  # it would make them
    batch = jax.eval_shape(lambda: data_lib.make_source(
        DataConfig(data_seed=1), cfg.vocab_size, batch=2, seq=16, accum=1).batch_at(0))
    kernels_as_references.clear()
    jax.eval_shape(lambda s, b: step_lib._grads(s, b, graphdef, cfg), state, batch)
    assert kernels_as_references == [(4, 256, 512), (4, 256, 256)] * (
        small_model.num_decoder_layers - small_model.first_num_dense_layers)


def test_no_codes_where_the_emulation_runs_or_by_default(small_model, kernels_as_references):
    """The emulation (or another recipe) reads no codes: none are made; nor by default
    (``gmm_fp8_weights_once_per_step`` is opt-in), where the kernels would read them."""
    cfg = _config(small_model, False)
    assert not dataclasses.replace(small_model.moe).gmm_fp8_weights_once_per_step
    graphdef, init = step_lib.init_state_fn(cfg, optax.identity(), 0)
    assert _codes(jax.eval_shape(init), graphdef, cfg) is None
    for moe in (dict(gmm_quantization="te_fp8_blockwise", gmm_fp8_impl="emulate"),
                dict(gmm_quantization="te_mxfp8"), dict()):
        cfg = dataclasses.replace(small_model, emb_dim=256, moe=dataclasses.replace(
            small_model.moe, moe_mlp_dim=256, gmm_fp8_weights_once_per_step=True, **moe))
        graphdef, init = step_lib.init_state_fn(cfg, optax.identity(), 0)
        assert _codes(jax.eval_shape(init), graphdef, cfg) is None, moe


def test_expert_parallelism_over_devices_quantizes_per_microbatch_and_says_so(
        small_model, kernels_as_references):
    """Over several expert ranks the codes would be made outside the expert-parallel
    region (each rank holds its own experts): no codes, and a warning names why."""
    from flax import nnx

    from dropless.nn.moe import MoEBlock, fp8_weight_codes, fp8_weight_codes_refusals
    from dropless.parallel.ep import ExpertParallel

    cfg = _config(small_model, True)
    mesh = jax.sharding.AbstractMesh((1, 1, 2), ("data", "fsdp", "expert"))
    for ep, refused in ((None, False), (ExpertParallel(mesh), True)):
        block = MoEBlock(cfg.moe, emb_dim=256, rngs=nnx.Rngs(0), ep=ep)
        whys = fp8_weight_codes_refusals(block)
        assert bool(whys) == refused and bool(fp8_weight_codes(block)) != refused
        if refused:
            assert whys == ["expert parallelism over 2 devices: the codes would be computed "
                            "outside the expert-parallel region"]
