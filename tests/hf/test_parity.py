"""dropless on the tiny DeepSeek-V3 of transformers: same logits, top-1 and routed experts.

The fixture (``tools/make_hf_fixture.py``) holds transformers' float32
logits and per-token routed experts for three directories of one model:
the published layout, the transformers 5 fused layout, and the published
layout in FP8 with an MTP layer (its reference ran the dequantized weights).

Tolerance: both sides run float32 on the same weights (bf16-representable
values, so the bf16 files are exact); they differ only in the order of
float32 sums (matmul blocking, the softmax and RMSNorm reductions), each a
relative error of a few 2^-24 per op over <= 160-term sums. Through 3 layers
that is ~1e-6 relative Frobenius error in the logits (measured 9.7e-7); the
bound is the issue's 1e-4, and top-1 tokens and routed experts must agree
exactly (their margins are far above 1e-6 on this fixture).
"""

import os

import numpy as np
import pytest
from hf_fixture import load_model, logits_and_experts, rel_fro

from dropless import cli

LAYOUTS = [("published", ""), ("fused", ""), ("fp8_mtp", "_fp8")]


# The FP8 + MTP directory's logits are checked by the routed-experts test below.
@pytest.mark.parametrize("layout, suffix", LAYOUTS[:2])
def test_forward_command_matches_transformers_logits(fixtures, tmp_path, layout, suffix):
    out = tmp_path / "logits.npy"
    code = cli.main(["forward", f"hf_model_path={os.path.join(fixtures, layout)}", "hardware=cpu",
                     "--tokens", os.path.join(fixtures, "tokens.npy"), "--out", str(out)])
    assert code == 0
    logits, ref = np.load(out), np.load(os.path.join(fixtures, f"logits{suffix}.npy"))
    assert logits.dtype == np.float32 and logits.shape == ref.shape
    assert rel_fro(logits, ref) < 1e-4
    np.testing.assert_array_equal(logits.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("layout, suffix", LAYOUTS)
def test_routed_experts_match_transformers(fixtures, monkeypatch, layout, suffix):
    """Each MoE layer sends each token to the experts transformers' router picked."""
    model, _ = load_model(os.path.join(fixtures, layout))
    logits, experts = logits_and_experts(model, np.load(os.path.join(fixtures, "tokens.npy")), monkeypatch)
    ref = np.load(os.path.join(fixtures, f"experts{suffix}.npy"))
    # Decoder MoE layers first; an MTP layer (fp8_mtp) routes after them.
    np.testing.assert_array_equal(experts[: len(ref)], ref)
    assert rel_fro(logits, np.load(os.path.join(fixtures, f"logits{suffix}.npy"))) < 1e-4
