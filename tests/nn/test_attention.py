"""cuDNN attention with MLA's v at its own head dim (``cudnn_mla_unpadded_v``).

The unpadded path calls jax's private cuDNN attention with v of head dim V < Q.
On CPU that function is replaced by the module's XLA reference (which takes
V != Q), so these tests check what dropless adds: v reaches cuDNN unpadded,
the output and gradients equal the padded path's, the key travels from the
config to the call, and every way the private API can be missing or refuse
becomes one ValueError naming the key. The GPU test at the end runs the real
kernels.

Legend: B batch, S sequence, H heads, Q q/k head dim, V v head dim.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

from dropless.config.loader import ConfigError, load_config
from dropless.config.sections import MLAConfig
from dropless.nn import attention

U_BF16 = 2.0**-8  # bf16 unit roundoff: 8 significand bits


def resolve(*overrides):
    return load_config(None, list(overrides), environ={})


def _qkv_dy(seed, b=2, s=16, h=3, q_dim=24, v_dim=16, dtype=jnp.bfloat16):
    kq, kk, kv, kg = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, s, h, q_dim), dtype)
    k = jax.random.normal(kk, (b, s, h, q_dim), dtype)
    v = jax.random.normal(kv, (b, s, h, v_dim), dtype)
    dy = jax.random.normal(kg, (b, s, h, v_dim), dtype)
    return q, k, v, dy


def _fake_cudnn(seen):
    """Stands in for the private cuDNN function: records what it got, then runs
    the XLA reference (causal, V != Q) with the same scale."""

    def fake(query, key, value, *, scale, mask_type):
        seen.append((query.shape, key.shape, value.shape, mask_type))
        return attention.dot_product_attention(query, key, value, scale=scale)

    return fake


def _value_and_grads(fn, q, k, v, dy):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(dy)


def test_unpadded_v_matches_the_padded_path_and_reaches_cudnn_unpadded(monkeypatch):
    """Output and q/k/v gradients of ``unpadded_v=True`` (private API, here the
    XLA reference) against the padded path (``jax.nn``'s XLA implementation).

    Tolerance: both take the same bf16 inputs, compute logits and the softmax
    in float32 and round to bf16 the probabilities, the products' cotangents
    (dP, dS) and each result: at most 3 roundings of relative size u = 2**-8
    per path, so the two paths differ by at most 2 x 3 u = 6 u (2.3%) of the
    magnitude of what they round (float32 accumulation adds ~S x 2**-24,
    negligible at S = 16); taken relative to max(1, max |padded|) of each
    array. v not reaching the function, a wrong slice, or dropped gradients
    differ by O(1) of that scale.
    """
    q, k, v, dy = _qkv_dy(seed=11)
    seen = []
    monkeypatch.setattr(cudnn_fa, "dot_product_attention", _fake_cudnn(seen))
    scale = 24**-0.5
    unpadded = lambda q, k, v: attention.fused_attention(q, k, v, scale=scale, unpadded_v=True)
    padded = lambda q, k, v: attention.fused_attention(q, k, v, scale=scale, implementation="xla")
    got, got_grads = jax.jit(lambda *a: _value_and_grads(unpadded, *a))(q, k, v, dy)
    want, want_grads = jax.jit(lambda *a: _value_and_grads(padded, *a))(q, k, v, dy)

    assert seen and all(s == ((2, 16, 3, 24), (2, 16, 3, 24), (2, 16, 3, 16), cudnn_fa.MaskType.CAUSAL)
                        for s in seen), seen
    assert got.shape == (2, 16, 3, 16) and got.dtype == jnp.bfloat16
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (want, *want_grads)):
        assert g.shape == w.shape, name
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=0, atol=6 * U_BF16 * max(1.0, np.abs(w).max()),
                                   err_msg=name)


def test_equal_head_dims_keep_the_public_path(monkeypatch):
    """V == Q (GQA, Qwen3): nothing to unpad, so the private function is not called."""
    q, k, _, _ = _qkv_dy(seed=12, q_dim=16)
    seen = []
    monkeypatch.setattr(cudnn_fa, "dot_product_attention", _fake_cudnn(seen))
    public = []
    real = jax.nn.dot_product_attention

    def recording(*a, **kw):
        public.append(kw["implementation"])
        return real(*a, **dict(kw, implementation="xla"))  # CPU: no cuDNN

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    out = attention.fused_attention(q, k, k, scale=0.25, unpadded_v=True)
    assert out.shape == k.shape and public == ["cudnn"] and seen == []


def test_a_refusing_or_missing_private_api_names_the_key(monkeypatch):
    q, k, v, _ = _qkv_dy(seed=13)

    def refuse(*a, **kw):  # what jax raises for cuDNN < 9.10 or a GPU before Hopper
        raise NotImplementedError("mla requires cudnn version >= 9.10 and at least hopper arch.")

    monkeypatch.setattr(cudnn_fa, "dot_product_attention", refuse)
    with pytest.raises(ValueError, match=r"cudnn_mla_unpadded_v=true: .* refused v head dim 16 "
                                         r"with q/k head dim 24 .*at least hopper arch; set cudnn_mla_unpadded_v=false"):
        attention.fused_attention(q, k, v, scale=0.25, unpadded_v=True)
    monkeypatch.delattr(cudnn_fa, "dot_product_attention")  # another jax version moved it
    with pytest.raises(ValueError, match="needs jax's private cuDNN attention .* not found in jax"):
        attention.fused_attention(q, k, v, scale=0.25, unpadded_v=True)
    with pytest.raises(ValueError, match="needs cuDNN attention, got implementation='xla'"):
        attention.fused_attention(q, k, v, scale=0.25, implementation="xla", unpadded_v=True)


def test_auto_takes_the_unpadded_call_where_it_runs_and_says_so(monkeypatch, caplog):
    q, k, v, _ = _qkv_dy(seed=15)
    seen = []
    monkeypatch.setattr(cudnn_fa, "dot_product_attention", _fake_cudnn(seen))
    attention._log_once.cache_clear()
    with caplog.at_level("WARNING", logger="dropless.nn.attention"):
        out = attention.fused_attention(q, k, v, scale=0.25, unpadded_v="auto")
        attention.fused_attention(q, k, v, scale=0.25, unpadded_v="auto")
    assert out.shape == v.shape and seen[0][2] == v.shape  # v at V=16, not Q=24
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["cudnn_mla_unpadded_v=auto: MLA's v goes to cuDNN at its own head dim 16 (q/k 24; no padding)"]


def test_auto_pads_where_the_private_call_refuses_and_says_why(monkeypatch, caplog):
    """auto falls back to the padded public call, with one log line giving jax's reason."""
    q, k, v, _ = _qkv_dy(seed=16)

    def refuse(*a, **kw):
        raise NotImplementedError("mla requires cudnn version >= 9.10 and at least hopper arch.")

    public = []
    real = jax.nn.dot_product_attention

    def recording(*a, **kw):
        public.append((kw["implementation"], a[2].shape))
        return real(*a, **dict(kw, implementation="xla"))  # CPU: no cuDNN

    monkeypatch.setattr(cudnn_fa, "dot_product_attention", refuse)
    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    attention._log_once.cache_clear()
    with caplog.at_level("WARNING", logger="dropless.nn.attention"):
        out = attention.fused_attention(q, k, v, scale=0.25, unpadded_v="auto")
    padded = attention.fused_attention(q, k, v, scale=0.25, implementation="xla")
    assert public[0] == ("cudnn", q.shape)  # v padded to Q=24
    np.testing.assert_array_equal(np.asarray(out), np.asarray(padded))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("cudnn_mla_unpadded_v=auto: MLA's v goes to cuDNN zero-padded to the q/k head dim (16 -> 24)")
    assert "at least hopper arch" in line and "set cudnn_mla_unpadded_v" not in line
    # With XLA attention auto means padded, without a word.
    caplog.clear()
    attention.fused_attention(q, k, v, scale=0.25, implementation="xla", unpadded_v="auto")
    assert caplog.records == []


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error where there is no cuDNN")
def test_the_real_private_api_without_a_gpu_gives_the_clear_error():
    """Without a GPU jax's function raises RuntimeError("cuDNN is not detected."),
    forward and under a gradient; both arrive as the one ValueError."""
    q, k, v, _ = _qkv_dy(seed=14)
    fn = lambda q: attention.fused_attention(q, k, v, scale=0.25, unpadded_v=True)
    for call in (lambda: fn(q), lambda: jax.jit(jax.grad(lambda q: fn(q).astype(jnp.float32).sum()))(q)):
        with pytest.raises(ValueError, match="cudnn_mla_unpadded_v=true: .*cuDNN is not detected; set") as err:
            call()
        assert isinstance(err.value.__cause__, RuntimeError)


def test_the_key_is_refused_without_cudnn_and_reaches_mla(monkeypatch):
    """Config -> MLAConfig -> MLA -> the private call, with v at V; dot_product refuses it."""
    with pytest.raises(ConfigError, match="cudnn_mla_unpadded_v=True .*with attention=dot_product only auto or false"):
        resolve("cudnn_mla_unpadded_v=true")
    assert resolve("attention=cudnn_flash_te", "dtype=bfloat16", "hardware=gpu").config.mla().cudnn_mla_unpadded_v == "auto"
    assert resolve("cudnn_mla_unpadded_v=false").config.mla().cudnn_mla_unpadded_v is False
    section = resolve("attention=cudnn_flash_te", "dtype=bfloat16", "hardware=gpu", "cudnn_mla_unpadded_v=true",
                      "num_query_heads=2", "qk_nope_head_dim=8", "qk_rope_head_dim=8", "v_head_dim=8",
                      "kv_lora_rank=8", "q_lora_rank=8").config.mla()
    assert section.cudnn_mla_unpadded_v is True
    seen = []
    monkeypatch.setattr(cudnn_fa, "dot_product_attention", _fake_cudnn(seen))
    mla = attention.MLA(section, emb_dim=16, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.ShapeDtypeStruct((1, 8, 16), jnp.bfloat16)
    out = jax.eval_shape(lambda x: mla(x, jnp.arange(8)[None]), x)
    assert out.shape == (1, 8, 16) and seen[0][2] == (1, 8, 2, 8)  # v at V=8, not Q=16
    with pytest.raises(ValueError, match="needs attention=cudnn_flash_te"):
        attention.MLA(dataclasses.replace(section, attention="dot_product"), emb_dim=16,
                      dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))


def _hopper_cudnn_910():
    if jax.default_backend() != "gpu":
        return False
    try:
        major = int(jax.devices()[0].compute_capability.split(".")[0])
        return major >= 9 and cudnn_fa.check_cudnn_version() >= 91000
    except Exception:  # noqa: BLE001 - any failure to tell means "cannot run here"
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_cudnn_910(), reason="needs a Hopper GPU with cuDNN >= 9.10")
@pytest.mark.parametrize("b,s,h", [(1, 1024, 16), (2, 4096, 128)])  # small; deepseek3-proxy's MLA
def test_cudnn_unpadded_v_matches_the_padded_cudnn_path_on_gpu(b, s, h):
    """The real private cuDNN kernels with V=128 against the padded public path
    (V zero-padded to Q=192), bf16, outputs and q/k/v gradients; the second
    shape is deepseek3-proxy's attention (batch 2, 4096 tokens, 128 heads).
    Only a Hopper GPU runs cuDNN's MLA mode; the CPU tests cover the plumbing
    with a stand-in.

    Tolerance: both are flash attention with bf16 operands and float32
    accumulation; the zero columns of the padded v add exact zeros, so the
    two differ only in blocking order and in which kernel cuDNN picks. Each
    path rounds to bf16 at most 3 times on the way to a result (P or dS
    before their matmuls, dP, the result), relative u = 2**-8 each: 6 u
    between the paths. The rounding errors of the S summed terms have random
    signs, so they grow like the sums themselves (sqrt(S)) and stay within
    6 u of the result's scale, measured as max(1, max |padded|) of each
    array; float32 accumulation over S <= 4096 adds < 2**-12 relative.
    A head or v-column mix-up, or a missing mask, differs by O(1).
    """
    q, k, v, dy = _qkv_dy(seed=21, b=b, s=s, h=h, q_dim=192, v_dim=128)
    scale = 192**-0.5
    run = lambda unpadded_v: jax.jit(lambda *a: _value_and_grads(
        lambda q, k, v: attention.fused_attention(q, k, v, scale=scale, unpadded_v=unpadded_v), *a))(q, k, v, dy)
    got, got_grads = run(True)
    want, want_grads = run(False)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (want, *want_grads)):
        assert g.shape == w.shape, name
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=0, atol=6 * U_BF16 * max(1.0, np.abs(w).max()),
                                   err_msg=name)
    # Against XLA's float32-softmax reference too (first sequence, 16 heads: its
    # [H, S, S] float32 logits stay ~1 GiB), so both cuDNN paths are not wrong alike.
    part = lambda t: t[:1, :, :16]
    ref = jax.jit(lambda q, k, v: attention.dot_product_attention(q, k, v, scale=scale))(
        part(q), part(k), part(v))
    ref = np.asarray(ref, np.float32)
    np.testing.assert_allclose(np.asarray(part(got), np.float32), ref, rtol=0,
                               atol=6 * U_BF16 * max(1.0, np.abs(ref).max()))
