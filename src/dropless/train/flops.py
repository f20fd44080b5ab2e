"""Analytic training FLOPs per device (MaxText's convention) and MFU.

Follows MaxText's ``calculate_tflops_training_per_device`` for DeepSeek-style
models (MLA attention, dense-first then MoE layers) and for grouped-query
attention (Qwen3-MoE: q H heads, k and v K heads), so TFLOPS/device figures
compare one-to-one with MaxText's logs:

* every matmul with a weight counts 2 * tokens * in * out FLOPs;
* experts count **dropless**: each token's ``num_experts_per_tok`` routed
  experts plus ``shared_experts``, plus the router ``2 * tokens * D * E``
  (no capacity padding, no dropped tokens);
* SwiGLU has two input matrices (gate, up) and one output matrix;
* attention scores and the weighted sum (``2 * tokens * S * H * (Q + V)``,
  H query heads whatever the kv heads) are halved for the causal mask;
* the output head counts once (``2 * tokens * D * V``), the embedding lookup 0;
* forward + backward = 3x forward; gradient accumulation multiplies it all.

One extension: MaxText omits the multi-token-prediction modules. Each MTP
depth here counts like one more decoder layer of the last kind plus its
``eh_proj`` (2D -> D) and one more output head, so the work MTP adds is
counted (with ``mtp_num_layers=0`` the result equals MaxText's).
"""

import dataclasses

from dropless.config.sections import ModelConfig

# Dense (no sparsity) peak TFLOP/s per device, by device_kind substring; the
# first match wins, so more specific names come first.
PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "fp8": 1513.0}),
    ("H100", {"bf16": 989.4, "fp8": 1978.9}),
    ("H200", {"bf16": 989.4, "fp8": 1978.9}),
    ("H800", {"bf16": 989.4, "fp8": 1978.9}),
    ("GH200", {"bf16": 989.4, "fp8": 1978.9}),
    ("GB200", {"bf16": 2500.0, "fp8": 5000.0}),
    ("B200", {"bf16": 2250.0, "fp8": 4500.0}),
    ("A100", {"bf16": 312.0}),
)


@dataclasses.dataclass(frozen=True)
class TrainingFlops:
    """TFLOPs of one training step on one device.

    total: learnable_weight + attention.
    learnable_weight: matmuls against parameters (projections, FFN, router, head).
    attention: causal q.k and p.v.
    """

    total: float
    learnable_weight: float
    attention: float


def _ffn_flops(tokens: float, emb_dim: int, mlp_dim: int) -> float:
    """One SwiGLU MLP: gate + up (2 matrices) and down."""
    return 2 * tokens * mlp_dim * emb_dim * 2 + 2 * tokens * mlp_dim * emb_dim


def _mla_flops(cfg: ModelConfig, tokens: float, seq: int):
    """(qkv projections, non-causal attention, output projection) FLOPs of one layer."""
    mla, d = cfg.mla, cfg.emb_dim
    h, qk = mla.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank == 0:
        q = 2 * tokens * d * h * qk
    else:
        q = 2 * tokens * (d * mla.q_lora_rank + mla.q_lora_rank * h * qk)
    kv = 2 * tokens * (
        d * (mla.kv_lora_rank + mla.qk_rope_head_dim)
        + mla.kv_lora_rank * h * (mla.qk_nope_head_dim + mla.v_head_dim)
    )
    attention = 2 * tokens * seq * h * (qk + mla.v_head_dim)
    projection = 2 * tokens * d * h * mla.v_head_dim
    return q + kv, attention, projection


def _gqa_flops(cfg: ModelConfig, tokens: float, seq: int):
    """(qkv projections, non-causal attention, output projection) FLOPs of one GQA layer.

    MaxText's count for grouped-query attention: q is H heads, k and v K heads
    each; the scores and the weighted sum run over all H query heads.
    """
    gqa, d = cfg.gqa, cfg.emb_dim
    h, kv, hd = gqa.num_heads, gqa.num_kv_heads, gqa.head_dim
    qkv = 2 * tokens * d * (h + 2 * kv) * hd
    attention = 2 * tokens * seq * h * (hd + hd)
    projection = 2 * tokens * h * hd * d
    return qkv, attention, projection


def _attention_flops(cfg: ModelConfig, tokens: float, seq: int):
    if cfg.attention_type == "gqa":
        return _gqa_flops(cfg, tokens, seq)
    return _mla_flops(cfg, tokens, seq)


def _moe_layer_ffn_flops(cfg: ModelConfig, tokens: float) -> float:
    moe = cfg.moe
    router = 2 * tokens * cfg.emb_dim * moe.num_experts
    expert = _ffn_flops(tokens, cfg.emb_dim, moe.moe_mlp_dim)
    return router + expert * (moe.shared_experts + moe.num_experts_per_tok)


def training_tflops_per_device(
    cfg: ModelConfig, per_device_batch_size: float, seq: int, gradient_accumulation_steps: int = 1
) -> TrainingFlops:
    """TFLOPs one device spends on one optimizer step (forward + backward).

    Args:
      cfg: the model.
      per_device_batch_size: sequences per device per microbatch (may be < 1).
      seq: tokens per sequence (``max_target_length``).
      gradient_accumulation_steps: microbatches per step.
    """
    tokens = per_device_batch_size * seq
    n_dense = cfg.first_num_dense_layers
    n_moe = cfg.num_decoder_layers - n_dense
    ffn = _ffn_flops(tokens, cfg.emb_dim, cfg.mlp_dim) * n_dense
    ffn += _moe_layer_ffn_flops(cfg, tokens) * n_moe
    qkv, attention, projection = _attention_flops(cfg, tokens, seq)
    head = 2 * tokens * cfg.emb_dim * cfg.vocab_size
    layers = cfg.num_decoder_layers
    weights = ffn + (qkv + projection) * layers + head
    attn = attention / 2 * layers  # causal: half the score matrix is masked
    if cfg.mtp_num_layers:
        mtp_ffn = _moe_layer_ffn_flops(cfg, tokens) if n_moe else _ffn_flops(
            tokens, cfg.emb_dim, cfg.mlp_dim
        )
        eh_proj = 2 * tokens * 2 * cfg.emb_dim * cfg.emb_dim
        weights += cfg.mtp_num_layers * (mtp_ffn + qkv + projection + eh_proj + head)
        attn += cfg.mtp_num_layers * attention / 2
    scale = 3 * gradient_accumulation_steps / 1e12
    return TrainingFlops(
        total=(weights + attn) * scale, learnable_weight=weights * scale, attention=attn * scale
    )


def peak_tflops(device_kind: str, precision: str = "bf16") -> float | None:
    """Dense peak TFLOP/s of one device of ``device_kind`` at ``precision``; None if unknown.

    ``precision`` is "bf16" or "fp8"; CPUs and unlisted GPUs give None (no MFU).
    """
    for name, peaks in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return peaks.get(precision)
    return None


def precision_of(cfg: ModelConfig) -> str:
    """The peak to compare against: fp8 when the model's matmuls are quantized to fp8."""
    quantized = "fp8" in cfg.quantization or "fp8" in cfg.moe.gmm_quantization
    return "fp8" if quantized else "bf16"
