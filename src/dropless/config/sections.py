"""Small frozen sub-configs, one per module: each module receives only its own.

The user-facing config (``schema.Config``) is flat and MaxText-compatible;
``Config.moe()``, ``Config.mla()`` ... cut it into these sections. Modules in
``nn``/``train``/``parallel`` take a section, never the whole job config.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routed + shared experts of one MoE layer."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_mlp_dim: int = 64
    shared_experts: int = 0
    # Routing.
    routed_score_func: str = "softmax"  # "softmax" (Mixtral/Qwen) | "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the chosen weights to sum to 1
    routed_scaling_factor: float = 1.0
    n_routing_groups: int = -1  # -1: no group-limited routing
    topk_routing_group: int = -1
    routed_bias: bool = False  # aux-loss-free balancing bias (selection only)
    routed_bias_update_rate: float = 0.0
    load_balance_loss_weight: float = 0.0  # Switch-style
    seq_aux_loss_weight: float = 0.0  # DeepSeek-V3 sequence-wise
    router_z_loss_weight: float = 0.0
    # Execution.
    sparse_matmul: bool = True  # dropless grouped-GEMM path; False: capacity baseline
    capacity_factor: float = 1.0  # only for sparse_matmul=False
    prefuse_moe_weights: bool = True  # gate|up stored as one [E, D, 2F] weight
    gmm_backend: str = "auto"  # reference | xla | mosaic | auto
    group_alignment: int = 1  # pad each expert's rows to a multiple (quantized kernels)
    gmm_quantization: str = "te_no_quant"  # te_no_quant | te_fp8_blockwise | te_mxfp8
    gmm_fp8_impl: str = "emulate"  # te_fp8_blockwise: emulate (qdq + bf16 gmm) | kernel (FP8 Mosaic)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2/V3)."""

    num_heads: int = 4
    q_lora_rank: int = 0  # 0: plain q projection
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_theta: float = 10000.0
    # YaRN RoPE scaling (factor 1.0 = none).
    rope_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    attention: str = "dot_product"  # dot_product | cudnn_flash_te
    normalization_layer_epsilon: float = 1e-6


@dataclasses.dataclass(frozen=True)
class GQAConfig:
    """Grouped-query attention (Llama/Qwen3): full-rank q, k, v; kv heads shared by groups of q heads."""

    num_heads: int = 4
    num_kv_heads: int = 4  # divides num_heads; each kv head serves num_heads // num_kv_heads q heads
    head_dim: int = 16  # q, k and v head dim (even: rotate-half RoPE)
    use_qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)
    rope_theta: float = 10000.0
    attention: str = "dot_product"  # dot_product | cudnn_flash_te
    normalization_layer_epsilon: float = 1e-6


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The decoder: MLA or GQA attention, dense-first then MoE layers."""

    vocab_size: int = 256
    emb_dim: int = 64
    num_decoder_layers: int = 2
    first_num_dense_layers: int = 1
    mlp_dim: int = 128  # dense SwiGLU layers
    dtype: str = "float32"  # activations
    weight_dtype: str = "float32"  # parameters
    normalization_layer_epsilon: float = 1e-6
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    scan_layers: bool = True
    remat_policy: str = "full"  # full | minimal | save_dot_except_mlp | custom | none
    # For remat_policy=custom: tensor name -> "remat" | "device" | "offload".
    remat_custom: tuple[tuple[str, str], ...] = ()
    quantization: str = ""  # "" (bf16) | te_fp8_currentscaling
    quantize_output_head: bool = False  # the output head in FP8 too (with te_fp8_currentscaling)
    attention_type: str = "mla"  # mla (reads ``mla``) | gqa (reads ``gqa``)
    mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)
    gqa: GQAConfig = dataclasses.field(default_factory=GQAConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh: ICI (within a slice/host) x DCN (across); -1 = fill."""

    ici_data_parallelism: int = 1
    ici_fsdp_parallelism: int = -1
    ici_expert_parallelism: int = 1
    ici_tensor_parallelism: int = 1
    dcn_data_parallelism: int = -1
    dcn_fsdp_parallelism: int = 1
    dcn_expert_parallelism: int = 1
    dcn_tensor_parallelism: int = 1
    ragged_buffer_factor: float = 2.0  # -1: exact worst case
    ep_overflow_check_every_n_steps: int = 20
    ep_overflow_policy: str = "error"  # error | warn
    ep_exchange: str = "auto"  # auto | ragged | padded
    ep_overflow_rounds: int = 0  # extra exchange rounds for what overflowed


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 3e-4
    warmup_steps_fraction: float = 0.1
    cosine_learning_rate_final_fraction: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    adam_weight_decay: float = 0.1
    gradient_clipping_threshold: float = 1.0
    mu_dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    dataset_type: str = "markov"  # synthetic | markov | text
    dataset_path: str = ""
    tokenizer_path: str = ""  # tokenizer.json; empty: bytes
    markov_order: int = 1
    markov_concentration: float = 0.1  # Dirichlet alpha of each transition row
    data_seed: int = 0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    per_device_batch_size: float = 2
    gradient_accumulation_steps: int = 1
    max_target_length: int = 64
    seed: int = 0
    run_name: str = ""
    base_output_directory: str = "runs"
    enable_checkpointing: bool = True
    checkpoint_period: int = 50
    async_checkpointing: bool = True
    max_num_checkpoints_to_keep: int = 0  # 0: keep all
    load_parameters_path: str = ""
    hf_model_path: str = ""  # Hugging Face directory to load parameters from
    log_period: int = 1
    enable_tensorboard: bool = True
    hardware: str = "gpu"
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
