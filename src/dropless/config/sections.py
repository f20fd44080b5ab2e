"""Small frozen sub-configs, one per module: each module receives only its own.

The user-facing config (``schema.Config``) is flat and MaxText-compatible;
``Config.moe()``, ``Config.mla()`` ... cut it into these sections. Modules in
``nn``/``train``/``parallel`` take a section, never the whole job config.
Defaults are the schema's (``_d``), so a section built directly (tests,
benchmarks) means what the same keys mean on the command line.
"""

import dataclasses

from dropless.config.schema import Config


def _d(key: str):
    """The schema's default of ``key``: every default has that one source."""
    return Config.model_fields[key].default


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routed + shared experts of one MoE layer."""

    num_experts: int = _d("num_experts")
    num_experts_per_tok: int = _d("num_experts_per_tok")
    moe_mlp_dim: int = _d("moe_mlp_dim")
    shared_experts: int = _d("shared_experts")
    # Routing.
    routed_score_func: str = _d("routed_score_func")  # "softmax" (Mixtral/Qwen) | "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = _d("norm_topk_prob")  # renormalise the chosen weights to sum to 1
    routed_scaling_factor: float = _d("routed_scaling_factor")
    n_routing_groups: int = _d("n_routing_groups")  # -1: no group-limited routing
    topk_routing_group: int = _d("topk_routing_group")
    routed_bias: bool = _d("routed_bias")  # aux-loss-free balancing bias (selection only)
    routed_bias_update_rate: float = _d("routed_bias_update_rate")
    load_balance_loss_weight: float = _d("load_balance_loss_weight")  # Switch-style
    seq_aux_loss_weight: float = _d("seq_aux_loss_weight")  # DeepSeek-V3 sequence-wise
    router_z_loss_weight: float = _d("router_z_loss_weight")
    # Execution.
    sparse_matmul: bool = _d("sparse_matmul")  # dropless grouped-GEMM path; False: capacity baseline
    capacity_factor: float = _d("capacity_factor")  # only for sparse_matmul=False
    prefuse_moe_weights: bool = _d("prefuse_moe_weights")  # gate|up stored as one [E, D, 2F] weight
    gmm_backend: str = _d("gmm_backend")  # reference | xla | mosaic | auto
    group_alignment: int = _d("moe_group_alignment")  # pad each expert's rows to a multiple (the quantized kernels raise it)
    gmm_quantization: str = _d("te_gmm_quantization")  # te_no_quant | te_fp8_blockwise | te_mxfp8
    gmm_fp8_impl: str = _d("gmm_fp8_impl")  # te_fp8_blockwise: auto | emulate (qdq + bf16 gmm) | kernel (FP8 Mosaic)
    gmm_fp8_quantizer: str = _d("gmm_fp8_quantizer")  # the kernels' operand quantization: auto | xla | pallas | mosaic
    gmm_fp8_kernel_schedule: str = _d("gmm_fp8_kernel_schedule")  # the kernels' step schedule: quantized.KERNEL_SCHEDULES
    gmm_fp8_weights_once_per_step: bool = _d("gmm_fp8_weights_once_per_step")  # GA > 1: expert weights quantized before the microbatch loop
    gmm_fp8_fused_swiglu: bool = _d("gmm_fp8_fused_swiglu")  # SwiGLU's output quantized in the pass that computes it


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2/V3)."""

    num_heads: int = _d("num_query_heads")
    q_lora_rank: int = _d("q_lora_rank")  # 0: plain q projection
    kv_lora_rank: int = _d("kv_lora_rank")
    qk_nope_head_dim: int = _d("qk_nope_head_dim")
    qk_rope_head_dim: int = _d("qk_rope_head_dim")
    v_head_dim: int = _d("v_head_dim")
    rope_theta: float = _d("rope_max_timescale")
    # YaRN RoPE scaling (factor 1.0 = none).
    rope_factor: float = _d("rope_factor")
    original_max_position_embeddings: int = _d("original_max_position_embeddings")
    beta_fast: float = _d("beta_fast")
    beta_slow: float = _d("beta_slow")
    mscale: float = _d("mscale")
    mscale_all_dim: float = _d("mscale_all_dim")
    attention: str = _d("attention")  # dot_product | cudnn_flash_te
    cudnn_mla_unpadded_v: bool | str = _d("cudnn_mla_unpadded_v")  # auto | True | False: cuDNN v at its own head dim (private JAX API)
    normalization_layer_epsilon: float = _d("normalization_layer_epsilon")


@dataclasses.dataclass(frozen=True)
class GQAConfig:
    """Grouped-query attention (Llama/Qwen3): full-rank q, k, v; kv heads shared by groups of q heads."""

    # The schema's -1 defaults ("as many kv heads as q heads", "emb_dim // heads") resolved.
    num_heads: int = _d("num_query_heads")
    num_kv_heads: int = _d("num_query_heads")  # divides num_heads; each kv head serves num_heads // num_kv_heads q heads
    head_dim: int = _d("emb_dim") // _d("num_query_heads")  # q, k and v head dim (even: rotate-half RoPE)
    use_qk_norm: bool = _d("use_qk_norm")  # RMSNorm over each q and k head before RoPE (Qwen3)
    rope_theta: float = _d("rope_max_timescale")
    attention: str = _d("attention")  # dot_product | cudnn_flash_te
    normalization_layer_epsilon: float = _d("normalization_layer_epsilon")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The decoder: MLA or GQA attention, dense-first then MoE layers."""

    vocab_size: int = _d("vocab_size")
    emb_dim: int = _d("emb_dim")
    num_decoder_layers: int = _d("num_decoder_layers")
    first_num_dense_layers: int = _d("first_num_dense_layers")
    mlp_dim: int = _d("mlp_dim")  # dense SwiGLU layers
    dtype: str = _d("dtype")  # activations
    weight_dtype: str = _d("weight_dtype")  # parameters
    normalization_layer_epsilon: float = _d("normalization_layer_epsilon")
    mtp_num_layers: int = _d("mtp_num_layers")
    mtp_loss_scaling_factor: float = _d("mtp_loss_scaling_factor")
    scan_layers: bool = _d("scan_layers")
    remat_policy: str = _d("remat_policy")  # full | minimal | minimal_with_context | minimal_flash | save_dot_except_mlp | custom | none
    # For remat_policy=custom: tensor name -> "remat" | "device" | "offload".
    remat_custom: tuple[tuple[str, str], ...] = ()
    quantization: str = _d("quantization")  # "" (bf16) | te_fp8_currentscaling
    quantize_output_head: bool = _d("quantize_output_head")  # the output head in FP8 too (with te_fp8_currentscaling)
    fp8_min_dim: int = _d("fp8_min_dim")  # dense matmuls with K or N below it stay bf16 under FP8 (inert without)
    fp8_dot_bf16_output: bool = _d("fp8_dot_bf16_output")  # FP8 dense GEMMs write bf16, power-of-two scales
    attention_type: str = _d("attention_type")  # mla (reads ``mla``) | gqa (reads ``gqa``)
    mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)
    gqa: GQAConfig = dataclasses.field(default_factory=GQAConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh: ICI (within a slice/host) x DCN (across); -1 = fill."""

    ici_data_parallelism: int = _d("ici_data_parallelism")
    ici_fsdp_parallelism: int = _d("ici_fsdp_parallelism")
    ici_expert_parallelism: int = _d("ici_expert_parallelism")
    ici_tensor_parallelism: int = _d("ici_tensor_parallelism")
    dcn_data_parallelism: int = _d("dcn_data_parallelism")
    dcn_fsdp_parallelism: int = _d("dcn_fsdp_parallelism")
    dcn_expert_parallelism: int = _d("dcn_expert_parallelism")
    dcn_tensor_parallelism: int = _d("dcn_tensor_parallelism")
    ragged_buffer_factor: float = _d("ragged_buffer_factor")  # -1: exact worst case
    ep_overflow_check_every_n_steps: int = _d("te_ep_overflow_check_every_n_steps")
    ep_overflow_policy: str = _d("ep_overflow_policy")  # error | warn
    ep_exchange: str = _d("ep_exchange")  # auto | ragged | padded
    ep_overflow_rounds: int = _d("ep_overflow_rounds")  # extra exchange rounds for what overflowed
    ep_pipeline_chunks: int = _d("ep_pipeline_chunks")  # token chunks exchanged and computed apart


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = _d("learning_rate")
    warmup_steps_fraction: float = _d("warmup_steps_fraction")
    cosine_learning_rate_final_fraction: float = _d("cosine_learning_rate_final_fraction")
    adam_b1: float = _d("adam_b1")
    adam_b2: float = _d("adam_b2")
    adam_eps: float = _d("adam_eps")
    adam_weight_decay: float = _d("adam_weight_decay")
    gradient_clipping_threshold: float = _d("gradient_clipping_threshold")
    mu_dtype: str = _d("mu_dtype")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    dataset_type: str = _d("dataset_type")  # synthetic | markov | text
    dataset_path: str = _d("dataset_path")
    tokenizer_path: str = _d("tokenizer_path")  # tokenizer.json; empty: bytes
    markov_order: int = _d("markov_order")
    markov_successors: int = _d("markov_successors")  # possible next tokens per state
    markov_concentration: float = _d("markov_concentration")  # Dirichlet alpha of each transition row
    data_seed: int = _d("data_seed")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = _d("steps")
    per_device_batch_size: float = _d("per_device_batch_size")
    gradient_accumulation_steps: int = _d("gradient_accumulation_steps")
    max_target_length: int = _d("max_target_length")
    seed: int = _d("seed")
    run_name: str = _d("run_name")
    base_output_directory: str = _d("base_output_directory")
    enable_checkpointing: bool = _d("enable_checkpointing")
    checkpoint_period: int = _d("checkpoint_period")
    async_checkpointing: bool = _d("async_checkpointing")
    max_num_checkpoints_to_keep: int = _d("max_num_checkpoints_to_keep")  # 0: keep all
    checkpoint_warm_host_memory: bool | str = _d("checkpoint_warm_host_memory")  # auto | True | False
    checkpoint_pinned_host_transfer: bool = _d("checkpoint_pinned_host_transfer")
    checkpoint_device_snapshot: bool = _d("checkpoint_device_snapshot")
    allow_config_change_on_resume: bool = _d("allow_config_change_on_resume")
    load_parameters_path: str = _d("load_parameters_path")
    hf_model_path: str = _d("hf_model_path")  # Hugging Face directory to load parameters from
    log_period: int = _d("log_period")
    enable_tensorboard: bool = _d("enable_tensorboard")
    hardware: str = _d("hardware")
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
