"""The flat, MaxText-compatible job config, validated once and frozen.

Every key a user can set is a field here with a description. Keys of the
MaxText/Transformer Engine recipe (``te_moe_block``, ``te_gmm_quantization``,
``ragged_buffer_factor`` ...) are accepted verbatim. Keys starting with
``xla_`` are XLA flags and ALL-CAPS keys are environment variables; both are
collected into ``xla_flags`` / ``env`` by the loader. ``Config.model()``,
``.train()``, ``.mesh()`` cut the flat config into the small frozen sections
of ``sections.py`` that modules receive.
"""

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:  # sections.py reads its defaults from Config: imported lazily below
    from dropless.config import sections

DType = Literal["float32", "bfloat16", "float16"]
RematChoice = Literal["remat", "device", "offload"]
# Tensor names a `remat_policy: custom` config can place: MaxText's names, then the
# FP8 codes only dropless makes (``train.remat``; ``minimal`` keeps them).
REMAT_TENSORS = (
    "decoder_layer_input", "context", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo",
    "query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj",
    "mla_q", "mla_kv", "moe_mlpwi", "moe_mlpwo",
    "moe_fp8_weights", "moe_fp8_input_codes", "fp8_dot_codes",
)


def _f(default, description, **kw):
    return Field(default, description=description, **kw)


class Config(BaseModel):
    """One training job. Unknown keys are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    # --- Run -------------------------------------------------------------------
    model_name: str = _f("deepseek3-tiny", "Model preset: loads config/models/<model_name>.yml.")
    run_name: str = _f("", "Run directory name under base_output_directory (default: derived from the model and time).")
    base_output_directory: str = _f("runs", "Where run directories (checkpoints, metrics, TensorBoard) go.")
    jax_cache_dir: str = _f("~/jax_cache", "JAX's persistent compilation cache directory (MaxText's key and default; ~ expands): a run whose step was compiled before loads it instead of compiling again (the proxy on an H200: compile and first step 91.9 s, then 36.7 s). Empty: no cache.")
    hardware: Literal["auto", "cpu", "gpu", "gpu_multiprocess", "tpu"] = _f("auto", "Target hardware (auto: GPU if present, else CPU); gpu_multiprocess joins the job through jax.distributed (JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID, or a cluster JAX detects: SLURM, Open MPI, Kubernetes); with none found it runs as one process on this host's GPUs and says so.")
    num_cpu_devices: int = _f(-1, "CPU only: devices per process (-1: the product of the fixed ici_*_parallelism axes, so ici_expert_parallelism=8 gives 8).", ge=-1)
    steps: int = _f(100, "Optimizer steps to run.", ge=1)
    seed: int = _f(0, "Seed of parameter initialisation and routing noise.")
    log_period: int = _f(1, "Steps between flushes of metrics.jsonl and TensorBoard (MaxText's meaning).", ge=1)
    enable_tensorboard: bool = _f(True, "Write TensorBoard event files in the run directory.")
    enable_checkpointing: bool = _f(True, "Save Orbax checkpoints.")
    async_checkpointing: bool = _f(True, "Save checkpoints in the background.")
    checkpoint_period: int = _f(1000, "Steps between checkpoints (the last step is always saved).", ge=1)
    max_num_checkpoints_to_keep: int = _f(3, "Keep the newest this many checkpoints, deleting older ones (0: keep all).", ge=0)
    checkpoint_warm_host_memory: Literal["auto"] | bool = _f("auto", "Async saves on GPU: grow XLA's pinned host memory pool to one save's size in a background thread, so the first save reuses it instead of pinning memory while the loop waits (later saves already do). It runs beside quiet steps: after the first timed window the loop puts the next steps' batches on the device (1.5x the warm-up's estimated span, at 0.8 GB/s) and runs them without fetching metrics until it ends, because copies between host and device wait for the pinning (on the H200 a loop fetching a scalar per iteration ran 58x slower beside it; one copying nothing kept its speed). Their rows are written when it ends; a wait for it (batches run out, a save, the end) is reported as checkpoint_warm_held_s. Measured on an H200 (deepseek3-proxy, 300 steps, train-20261202-200513): 41 GiB pinned in 35 s beside the quiet steps at full speed, the save then held the loop 0.90 s (0.3% of the run's wall time) instead of about 38 s. auto = on where it helps (async saves on a GPU with pinned host memory), silently off elsewhere; true = on, or one line saying why it cannot be; false = off (the first save pins while the loop waits).")
    checkpoint_pinned_host_transfer: bool = _f(True, "Async saves on GPU: copy the state to pinned host memory before the save returns (Orbax's default on GPU: the fastest copy, but the first save pins one save's worth of host memory while the loop waits, about 38 s for the proxy's 41 GiB on the H200; later saves reuse it, 0.9 s). false: pageable copies, slower on every save but with no one-time pinning.")
    checkpoint_device_snapshot: bool = _f(False, "Async saves: copy the train state on the device (at device memory bandwidth) and hand the copy to Orbax in a background thread, so its copy to host memory runs beside the next steps instead of holding the loop; the copy's device memory is freed when Orbax lets it go (by the end of its write). Needs room for one more copy of the state on each device: the run compiles its step first and stops (naming this key) if XLA's peak plus the copy exceeds the device's memory; the dry run counts the copy. Needs async_checkpointing=true and a single process: Orbax's save synchronises the processes with a collective over all devices, which, launched from a background thread between the steps' own collectives, could run in a different order on each process and hang, so a multi-process run with the key is refused. Measured on an H200 with the 41 GiB proxy state: the save call held the loop 0.2 s instead of 32-38 s, but the steps during Orbax's copy to host slowed down by about as much (benchmarks/notes/memory.md), hence off by default.")
    allow_config_change_on_resume: bool = _f(False, "Resume a run whose config.json differs from this config (the differences are printed and logged to config_changes.jsonl); false: refuse.")
    load_parameters_path: str = _f("", "Initialise parameters from this checkpoint directory.")
    hf_model_path: str = _f("", "A local Hugging Face model directory (config.json + *.safetensors, single or sharded with an index): the model keys come from its config.json (a key also given must agree) and the parameters from its tensors (train fine-tunes from them; forward and profile run them).")

    # --- Batch and data --------------------------------------------------------
    per_device_batch_size: float = _f(2, "Sequences per device per step (fractions allowed if the global batch is whole).", gt=0)
    gradient_accumulation_steps: int = _f(1, "Microbatches accumulated per optimizer step.", ge=1)
    max_target_length: int = _f(64, "Sequence length in tokens.", ge=2)
    dataset_type: Literal["synthetic", "markov", "text"] = _f("markov", "synthetic: random tokens; markov: seeded Markov source with known entropy; text: local files.")
    dataset_path: str = _f("", "Text data: a .txt/.jsonl/.parquet file or a directory of them (tokenized whole by every process), or one .npy file of token ids (1-D, memory-mapped; each process reads only its windows; `dropless tokenize` writes one).")
    tokenizer_path: str = _f("", "tokenizer.json for text data (default: bytes).")
    markov_order: int = _f(1, "Order of the Markov source (the state is the last markov_order tokens).", ge=1)
    markov_successors: int = _f(64, "Possible next tokens per Markov state (all V if fewer): the table is V**markov_order x markov_successors, so any vocabulary works.", ge=1)
    markov_concentration: float = _f(0.1, "Dirichlet alpha of each Markov transition row (lower: more predictable).", gt=0)
    data_seed: int = _f(0, "Seed of the data stream.")

    # --- Model -----------------------------------------------------------------
    vocab_size: int = _f(256, "Vocabulary size.", ge=2)
    emb_dim: int = _f(64, "Model width D.", ge=1)
    num_decoder_layers: int = _f(2, "Decoder layers.", ge=1)
    first_num_dense_layers: int = _f(1, "Leading layers with a dense MLP instead of MoE.", ge=0)
    mlp_dim: int = _f(128, "Dense MLP hidden width.", ge=1)
    num_query_heads: int = _f(4, "Attention heads.", ge=1)
    dtype: DType = _f("float32", "Activation dtype.")
    weight_dtype: DType = _f("float32", "Parameter dtype.")
    normalization_layer_epsilon: float = _f(1e-6, "RMSNorm epsilon.", gt=0)
    mtp_num_layers: int = _f(0, "Multi-token-prediction modules (DeepSeek-V3 uses 1).", ge=0)
    mtp_loss_scaling_factor: float = _f(0.1, "Weight of the MTP loss.", ge=0)
    scan_layers: bool = _f(True, "Stack layers with scan (compile time independent of depth).")
    attention: Literal["dot_product", "cudnn_flash_te"] = _f("dot_product", "Attention kernel: XLA dot-product or cuDNN flash attention.")
    cudnn_mla_unpadded_v: Literal["auto"] | bool = _f("auto", "attention=cudnn_flash_te with MLA: give cuDNN v at its own head dim (v_head_dim, 128 in DeepSeek-V3) instead of zero-padded to the q/k head dim (192), saving the padded part of P.V and its gradients (deepseek3-proxy on an H200: 1.06x the step). Uses a private JAX API (jax._src.cudnn, jax 0.11.2 as pinned) and needs cuDNN >= 9.10 on a Hopper or newer GPU. auto = unpadded where that runs, else padded, and the log says which and why; true = unpadded or an error naming this key; false = padded. No effect with attention_type=gqa (q, k and v share one head dim there) or attention=dot_product.")
    decoder_block: Literal["custom", "deepseek", "qwen3_moe", "mixtral"] = _f("custom", "Layer structure the other keys must describe: deepseek (MLA attention), qwen3_moe (transformers' Qwen3MoeForCausalLM: GQA with q/k RMSNorm, softmax top-k routing over all experts, no shared expert, no routing bias or scaling, no MTP), mixtral (transformers' MixtralForCausalLM: as qwen3_moe but without q/k norm, every layer MoE, the top-k weights always renormalised), custom (any combination). Checked only; layers read the keys themselves.")
    attention_type: Literal["mla", "gqa"] = _f("mla", "Attention module: mla (DeepSeek latent attention; the MLA keys) or gqa (grouped-query attention; num_kv_heads, head_dim, use_qk_norm).")
    # GQA
    num_kv_heads: int = _f(-1, "GQA: key/value heads, dividing num_query_heads (-1: num_query_heads, plain multi-head attention).", ge=-1)
    head_dim: int = _f(-1, "GQA: per-head q/k/v dim, even (-1: emb_dim // num_query_heads).", ge=-1)
    use_qk_norm: bool = _f(False, "GQA: RMSNorm over each query and key head before RoPE (Qwen3).")
    # MLA
    q_lora_rank: int = _f(0, "Low-rank query compression (0: full-rank query projection).", ge=0)
    kv_lora_rank: int = _f(32, "Compressed KV rank.", ge=1)
    qk_nope_head_dim: int = _f(16, "Per-head query/key dim without RoPE.", ge=1)
    qk_rope_head_dim: int = _f(8, "Per-head decoupled RoPE dim.", ge=2)
    v_head_dim: int = _f(16, "Per-head value dim.", ge=1)
    rope_max_timescale: float = _f(10000.0, "RoPE base (theta).", gt=0)
    rope_factor: float = _f(1.0, "YaRN context-extension factor (1: no scaling).", ge=1)
    original_max_position_embeddings: int = _f(4096, "YaRN: pre-extension context length.", ge=1)
    beta_fast: float = _f(32.0, "YaRN beta_fast.")
    beta_slow: float = _f(1.0, "YaRN beta_slow.")
    mscale: float = _f(1.0, "YaRN attention mscale.")
    mscale_all_dim: float = _f(1.0, "YaRN mscale_all_dim.")

    # --- MoE -------------------------------------------------------------------
    num_experts: int = _f(8, "Routed experts E.", ge=1)
    num_experts_per_tok: int = _f(2, "Experts per token (top-k).", ge=1)
    moe_mlp_dim: int = _f(64, "Routed expert hidden width F.", ge=1)
    shared_experts: int = _f(0, "Shared experts (dense, width shared_experts x moe_mlp_dim).", ge=0)
    n_routing_groups: int = _f(-1, "Expert groups for group-limited routing (-1: off).")
    topk_routing_group: int = _f(-1, "Groups kept per token in group-limited routing (-1: off).")
    routed_scaling_factor: float = _f(1.0, "Multiplier of the routing weights.", gt=0)
    routed_score_func: Literal["softmax", "sigmoid"] = _f("softmax", "Router score: softmax (Mixtral/Qwen) or sigmoid (DeepSeek-V3).")
    norm_topk_prob: bool = _f(True, "Renormalise the chosen experts' weights to sum to 1.")
    routed_bias: bool = _f(False, "Aux-loss-free balancing bias (changes selection only).")
    routed_bias_update_rate: float = _f(0.0, "Bias step per optimizer step: bias += rate * sign(mean_load - load).", ge=0)
    load_balance_loss_weight: float = _f(0.0, "Switch-style load-balance loss weight.", ge=0)
    seq_aux_loss_weight: float = _f(0.0, "DeepSeek-V3 sequence-wise balance loss weight.", ge=0)
    router_z_loss_weight: float = _f(0.0, "Router z-loss weight.", ge=0)
    sparse_matmul: bool = _f(True, "true: dropless grouped-GEMM path; false: capacity-based dense_matmul baseline.")
    capacity_factor: float = _f(1.0, "Expert capacity factor of the dense_matmul baseline (tokens past it are dropped).", gt=0)
    prefuse_moe_weights: bool = _f(True, "Store gate and up projections as one [E, D, 2F] weight; one grouped GEMM instead of two.")
    gmm_backend: Literal["reference", "xla", "mosaic", "auto"] = _f("auto", "Grouped matmul backend.")
    moe_group_alignment: int = _f(1, "Pad each expert's rows in the dropless buffer to a multiple of this (zero rows, at most E x (this - 1) more rows; FP8 recipes raise it to their scale block). At a multiple of 64 no group boundary falls inside the bf16 Mosaic kernels' 64-row steps, so the weight-gradient kernel masks no rows.", ge=1, le=1024)
    te_moe_block: bool = _f(True, "Accepted for MaxText recipes: dropless's MoE block is always the fused one, so only true is allowed.")
    te_gmm_quantization: Literal["te_no_quant", "te_fp8_blockwise", "te_mxfp8"] = _f("te_no_quant", "Expert grouped-GEMM quantization recipe.")
    gmm_fp8_impl: Literal["auto", "emulate", "kernel"] = _f("auto", "How te_fp8_blockwise grouped GEMMs run: kernel = the FP8 Mosaic GPU kernels on E4M3 codes (Hopper only; emb_dim and moe_mlp_dim multiples of 256; on an H200 the proxy's step ran at 1.106x bf16 with them and FP8 dense layers, step-20261204-154906); emulate = quantize -> dequantize -> the bf16 grouped GEMM (the same FP8 numerics, bf16 speed); auto = kernel where it can run (Hopper, gmm_backend auto or mosaic, dims multiples of 256), else emulate, and the log says which and why.")
    gmm_fp8_quantizer: Literal["auto", "xla", "pallas", "mosaic"] = _f("auto", "How the FP8 grouped-GEMM kernels quantize their operands (all give the same codes and scales bit for bit): mosaic = single-pass Mosaic GPU kernels (bfloat16 operands only); pallas = single-pass Pallas kernels on Triton (any float dtype); xla = ops.quant fused by XLA; auto = mosaic for bfloat16 operands, pallas for others. On an H200 the FP8 proxy step ran at 1.088x bf16 with mosaic against 1.078x with Mosaic GPU weights and Triton activations, in one run (step-20261203-054415); fwd+dgrad+wgrad with xla's quantization ran at 0.89x bf16.")
    gmm_fp8_kernel_schedule: Literal["default", "narrow", "halves_unfenced", "p96_32_unfenced", "xhalves_unfenced", "wide_o192", "wide_n160", "wide_n192", "wide_o192_n160", "wide_o192_n192", "wide_o192_n160_under"] = _f("default", "How the FP8 grouped-GEMM kernels schedule their 128-wide steps (the same bits with each): default = wide_o192_n160, the forward and dgrad with 128x192 CTA tiles and the wgrad with 128x160 ones (the default since 2026-12-06: kernels 1.07-1.09x narrow's, the proxy's step 1.013x and 1.014x narrow's in two runs, 1.127x bf16 in step-20261206-035133); narrow = the kernels' 128x128 tiles (the default until 2026-12-06; the ratios below are against it); wide_o192 = the forward and dgrad wide only, wide_n160 / wide_n192 = the wgrad wide only (192-column wgrad tiles spill, about 560 TF/s), wide_o192_n192 = both; wide_o192_n160_under = the default's tiles with each step's scale reads and their fence between its wgmma's issue and its wait instead of before the issue (on an H200 the forward and dgrad ran even and the wgrad 0.86x, fp8_kernels-20261206-215854: slower). On an H200 at K=2048 N=7168 the wide tiles ran fwd 1,191 / dgrad 1,281 TF/s against 1,090 / 1,201 and wgrad 892 against 834 (fp8_kernels-20261205-152047); fwd+dgrad+wgrad with its quantization at K=7168 N=4096 1.25x our bf16 kernels against 1.22x (fp8_quant-20261205-152503); the proxy's step 1.013x narrow (one run, step-20261205-152704). halves_unfenced = each step as two wgmmas over 64-column halves, the first half's promotion under the second half's wgmma, and the forward's and dgrad's scale reads without the proxy fence, as DeepGEMM; p96_32_unfenced = the same with a 96- and a 32-column wgmma per step; xhalves_unfenced = the forward's and dgrad's halves across steps; each on the 128x128 tiles. In the proxy's training step on an H200 none pays (1.004x, 0.998x and 0.967x narrow; step-fp8-schedules-20261205-015359, step-fp8-xhalves-20261205-015824). Needs the kernels: te_gmm_quantization=te_fp8_blockwise and gmm_fp8_impl auto or kernel.")
    gmm_fp8_weights_once_per_step: bool = _f(False, "With gradient_accumulation_steps > 1 and the FP8 grouped-GEMM kernels: quantize the expert weights once per optimizer step, before the microbatch loop (both byte layouts, held through the step), instead of once per microbatch. The same codes, so the same bits. On an H200 the proxy at gradient_accumulation_steps=2 ran at 526.1 TFLOPS/device with it against 525.7 without (1.001x) and peaked 4.0 GiB higher (97.5 against 93.5 GiB; step-fp8-ga2-weights-once-20261205-032126), so it is opt-in: it pays where quantizing the weights is large beside the microbatch's expert GEMMs (many local experts, few rows each). Under expert parallelism over several devices the weights are quantized per microbatch, and the run says so.")
    gmm_fp8_fused_swiglu: bool = _f(False, "With the FP8 grouped-GEMM kernels and prefuse_moe_weights=true: quantize SwiGLU's output for the down projection in the pass that computes it. One Mosaic GPU kernel reads gate|up and writes the FP8 codes (silu(gate) * up in float32, rounded to bf16 once, never written out); the backward recomputes it the same way in its 128x1 quantizer. Off: XLA computes SwiGLU (rounding after each operation) and the quantizer reads it. On an H200 the fused passes, on half tiles, take 0.203 ms against 0.306 for SwiGLU then the plain rows pass at [65536, 4096] (fp8_quant_swiglu-20261207-181610); on whole tiles the proxy step had run 1.009x without it (one run): opt-in until the step times the half tiles.")
    quantization: Literal["", "te_fp8_currentscaling"] = _f("", "Dense-matmul quantization ('' = bf16/fp32 as dtype; te_fp8_currentscaling: attention projections, dense MLP and shared experts in FP8 with per-tensor current scaling).")
    quantize_output_head: bool = _f(False, "With quantization=te_fp8_currentscaling, compute the output head in FP8 too.")
    fp8_min_dim: int = _f(4096, "With quantization=te_fp8_currentscaling: dense matmuls whose contraction size K or output width N is below this stay bf16, and the run says which at start (0: all in FP8, as MaxText and Transformer Engine do). 4096 keeps the proxy's narrow projections in bf16 (MLA's wq_a/wq_b/wkv_a/wkv_b, N or K 512-1536, and the shared experts at 2048, whose FP8 forms ran at 0.57-0.97x bf16 on an H200, fp8_dense-20261202-001951). Proxy step on one H200: scan layers 471.4 TFLOPS/device against 463.3 for all-FP8 and 436.4 for bf16 (1.080x against 1.062x bf16, step-20261202-045852); unrolled 503.8 against 484.5 bf16 (1.040x, step-20261202-050929). Setting it without quantization=te_fp8_currentscaling is an error; the default is then inert.")
    fp8_dot_bf16_output: bool = _f(False, "With quantization=te_fp8_currentscaling: the FP8 dense GEMMs write their bfloat16 results directly (cuBLASLt's output in bfloat16, scaled there) instead of float32 and then a scale-and-convert pass, and every operand of them gets a power-of-two per-tensor scale (Transformer Engine's force_pow_2_scales), which makes the bfloat16 scaling exact: the same bits as float32 outputs with those scales, the accumulator rounded once. In deepseek3-proxy's step compiled for an H200 the 21 FP8 GEMMs then write bf16, and 7 convert passes and the float32 reads of the others go: about 12.6 GB of traffic per step. Off until timed on the GPU (benchmarks/notes/fp8.md). XLA may still split a small GEMM's contraction into batched GEMMs (its splitk-rewriter pass, by shape): those write float32 partials and one fusion sums them into bfloat16 (the proxy's step has none). Setting it without quantization=te_fp8_currentscaling is an error.")

    # --- Remat / offload -------------------------------------------------------
    remat_policy: Literal["full", "minimal", "minimal_with_context", "minimal_flash", "save_dot_except_mlp", "custom", "none"] = _f("full", "Activation rematerialisation policy (MaxText's names). minimal: keep the matmul outputs without batch dimensions, the expert kernels' outputs and the FP8 codes; minimal_with_context (minimal_flash is MaxText's older name for it): those and attention's q, k, v and output (query_proj, key_proj, value_proj, context), with cuDNN attention its softmax statistics too, so the backward pass runs no attention forward again.")
    # Per-tensor placement for remat_policy=custom (MaxText's names).
    decoder_layer_input: RematChoice | None = _f(None, "remat_policy=custom: where 'decoder_layer_input' is kept (remat | device | offload).")
    context: RematChoice | None = _f(None, "remat_policy=custom: where 'context' (the attention output; with cuDNN attention also its softmax statistics, so that device or offload leaves no attention forward to recompute) is kept (remat | device | offload).")
    mlpwi: RematChoice | None = _f(None, "remat_policy=custom: where 'mlpwi' is kept (remat | device | offload).")
    mlpwi_0: RematChoice | None = _f(None, "remat_policy=custom: where 'mlpwi_0' is kept (remat | device | offload).")
    mlpwi_1: RematChoice | None = _f(None, "remat_policy=custom: where 'mlpwi_1' is kept (remat | device | offload).")
    mlpwo: RematChoice | None = _f(None, "remat_policy=custom: where 'mlpwo' is kept (remat | device | offload).")
    query_proj: RematChoice | None = _f(None, "remat_policy=custom: where 'query_proj' is kept (remat | device | offload).")
    key_proj: RematChoice | None = _f(None, "remat_policy=custom: where 'key_proj' is kept (remat | device | offload).")
    value_proj: RematChoice | None = _f(None, "remat_policy=custom: where 'value_proj' is kept (remat | device | offload).")
    qkv_proj: RematChoice | None = _f(None, "remat_policy=custom: where 'qkv_proj' is kept (remat | device | offload).")
    out_proj: RematChoice | None = _f(None, "remat_policy=custom: where 'out_proj' is kept (remat | device | offload).")
    mla_q: RematChoice | None = _f(None, "remat_policy=custom: where 'mla_q' is kept (remat | device | offload).")
    mla_kv: RematChoice | None = _f(None, "remat_policy=custom: where 'mla_kv' is kept (remat | device | offload).")
    moe_mlpwi: RematChoice | None = _f(None, "remat_policy=custom: where 'moe_mlpwi' is kept (remat | device | offload).")
    moe_mlpwo: RematChoice | None = _f(None, "remat_policy=custom: where 'moe_mlpwo' is kept (remat | device | offload).")
    moe_fp8_weights: RematChoice | None = _f(None, "remat_policy=custom: where the FP8 expert kernels' weight codes (both byte layouts and scales) are kept (remat | device | offload); remat quantizes each expert weight again in the backward pass.")
    moe_fp8_input_codes: RematChoice | None = _f(None, "remat_policy=custom: where the FP8 expert kernels' 128x1 input codes for wgrad are kept (remat | device | offload); remat recomputes the expert inputs and their quantization in the backward pass.")
    fp8_dot_codes: RematChoice | None = _f(None, "remat_policy=custom: where the FP8 dense products' operand codes and scales are kept (remat | device | offload); remat recomputes their inputs and quantization in the backward pass.")

    # --- Optimizer -------------------------------------------------------------
    learning_rate: float = _f(3e-4, "Peak learning rate.", gt=0)
    warmup_steps_fraction: float = _f(0.1, "Fraction of steps of linear warm-up.", ge=0, le=1)
    cosine_learning_rate_final_fraction: float = _f(0.1, "Final LR as a fraction of the peak.", ge=0, le=1)
    adam_b1: float = _f(0.9, "AdamW beta1.", ge=0, lt=1)
    adam_b2: float = _f(0.95, "AdamW beta2.", ge=0, lt=1)
    adam_eps: float = _f(1e-8, "AdamW epsilon.", gt=0)
    adam_weight_decay: float = _f(0.1, "AdamW decoupled weight decay.", ge=0)
    gradient_clipping_threshold: float = _f(1.0, "Global-norm clip (0: off).", ge=0)
    mu_dtype: DType = _f("float32", "AdamW first-moment dtype.")

    # --- Mesh and expert parallelism -------------------------------------------
    ici_data_parallelism: int = _f(1, "Data-parallel ways within a host (-1: fill).")
    ici_fsdp_parallelism: int = _f(-1, "FSDP ways within a host (-1: fill).")
    ici_expert_parallelism: int = _f(1, "Expert-parallel ways within a host (-1: fill).")
    ici_tensor_parallelism: int = _f(1, "Tensor-parallel ways within a host: only 1 (dropless shards by data, FSDP and experts; no layer is split over a tensor axis).")
    dcn_data_parallelism: int = _f(-1, "Data-parallel ways across hosts (-1: fill).")
    dcn_fsdp_parallelism: int = _f(1, "FSDP ways across hosts.")
    dcn_expert_parallelism: int = _f(1, "Expert-parallel ways across hosts.")
    dcn_tensor_parallelism: int = _f(1, "Tensor-parallel ways across hosts: only 1 (as ici_tensor_parallelism).")
    ragged_buffer_factor: float = _f(2.0, "Expert-parallel receive buffer as a multiple of the balanced load (-1: exact worst case; must be -1 or >= 1).")
    te_ep_overflow_check_every_n_steps: int = _f(20, "Steps between host reads of the on-device overflow counters.", ge=1)
    ep_overflow_policy: Literal["error", "warn"] = _f("error", "On receive-buffer overflow: stop with a clear error, or warn and continue (overflowing steps are skipped either way).")
    ep_exchange: Literal["auto", "ragged", "padded"] = _f("auto", "Expert-parallel exchange: ragged_all_to_all (GPU) or padded all_to_all (any platform).")
    ep_pipeline_chunks: int = _f(1, "Split each rank's tokens into this many chunks, each dispatched, computed and combined on its own, so XLA can overlap one chunk's token exchange with another's expert GEMMs (1: one exchange per direction; not yet timed on GPUs).", ge=1, le=8)
    ep_overflow_rounds: int = _f(0, "Extra expert-parallel exchange rounds that deliver the rows and expert copies a step's buffers could not hold, so nothing is dropped and the step is not skipped; they run only when some rank overflowed (0: overflow skips the step).", ge=0, le=8)

    # --- XLA flags and environment (collected from xla_* / ALL-CAPS keys) -------
    xla_flags: dict[str, Any] = _f({}, "XLA flags (keys starting with xla_), applied on GPU before the backend starts.")
    env: dict[str, str] = _f({}, "Environment variables (ALL-CAPS keys), set before the backend starts.")

    @field_validator("run_name", "base_output_directory", "dataset_path", "tokenizer_path",
                     "load_parameters_path", mode="before")
    @classmethod
    def _number_as_text(cls, v):
        # YAML reads run_name=123 as an int; a name or path made of digits is still text.
        return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _contradictions(self):
        _check_contradictions(self)
        return self

    # --- Sections ----------------------------------------------------------------
    def moe(self) -> "sections.MoEConfig":
        return _section("MoEConfig", self, rename={"gmm_quantization": "te_gmm_quantization",
                                                        "group_alignment": "moe_group_alignment"})

    def mla(self) -> "sections.MLAConfig":
        return _section("MLAConfig", self, rename={
            "num_heads": "num_query_heads", "rope_theta": "rope_max_timescale"})

    def gqa(self) -> "sections.GQAConfig":
        return _section("GQAConfig", self, num_kv_heads=_kv_heads(self), head_dim=_head_dim(self),
                        rename={"num_heads": "num_query_heads", "rope_theta": "rope_max_timescale"})

    def model(self) -> "sections.ModelConfig":
        custom = tuple((n, getattr(self, n)) for n in REMAT_TENSORS if getattr(self, n) is not None)
        return _section("ModelConfig", self, mla=self.mla(), gqa=self.gqa(), moe=self.moe(),
                        remat_custom=custom)

    def optimizer(self) -> "sections.OptimizerConfig":
        return _section("OptimizerConfig", self)

    def data(self) -> "sections.DataConfig":
        return _section("DataConfig", self)

    def train(self) -> "sections.TrainConfig":
        return _section("TrainConfig", self, optimizer=self.optimizer(), data=self.data())

    def mesh(self) -> "sections.MeshConfig":
        return _section("MeshConfig", self, rename={
            "ep_overflow_check_every_n_steps": "te_ep_overflow_check_every_n_steps"})


def _section(name, cfg, rename=None, **given):
    """Build section ``sections.<name>`` from same-named (or renamed) config fields."""
    import dataclasses

    from dropless.config import sections  # not at the top: sections reads Config's defaults

    cls = getattr(sections, name)
    rename = rename or {}
    kwargs = dict(given)
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            continue
        src = rename.get(f.name, f.name)
        if src in Config.model_fields:
            kwargs[f.name] = getattr(cfg, src)
    return cls(**kwargs)


def _kv_heads(c) -> int:
    return c.num_query_heads if c.num_kv_heads == -1 else c.num_kv_heads


def _head_dim(c) -> int:
    return c.emb_dim // c.num_query_heads if c.head_dim == -1 else c.head_dim


# What each decoder_block fixes: key -> (required value, why). qwen3_moe and
# mixtral are the structures of transformers' Qwen3MoeForCausalLM and
# MixtralForCausalLM, so a model of either block can be written as one;
# n_routing_groups has its own message (see below).
DECODER_BLOCKS = {
    "custom": {},
    "deepseek": {"attention_type": ("mla", "DeepSeek-V3 uses MLA attention")},
    "qwen3_moe": {
        "attention_type": ("gqa", "Qwen3-MoE uses grouped-query attention"),
        "use_qk_norm": (True, "Qwen3-MoE normalises each q and k head"),
        "shared_experts": (0, "Qwen3-MoE has no shared expert"),
        "routed_score_func": ("softmax", "Qwen3-MoE routes with a softmax"),
        "routed_bias": (False, "Qwen3-MoE has no selection bias"),
        "routed_scaling_factor": (1.0, "Qwen3-MoE does not scale routing weights"),
        "mtp_num_layers": (0, "Qwen3-MoE has no multi-token prediction"),
    },
    "mixtral": {
        "attention_type": ("gqa", "Mixtral uses grouped-query attention"),
        "use_qk_norm": (False, "Mixtral does not normalise q and k heads"),
        "first_num_dense_layers": (0, "every Mixtral layer is MoE"),
        "shared_experts": (0, "Mixtral has no shared expert"),
        "routed_score_func": ("softmax", "Mixtral routes with a softmax"),
        "norm_topk_prob": (True, "Mixtral renormalises its top-k weights"),
        "routed_bias": (False, "Mixtral has no selection bias"),
        "routed_scaling_factor": (1.0, "Mixtral does not scale routing weights"),
        "mtp_num_layers": (0, "Mixtral has no multi-token prediction"),
    },
}
# The blocks that route over all experts, for the group-limited-routing message.
_ALL_EXPERT_ROUTING = {"qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral"}


class ContradictionError(ValueError):
    """Two or more keys are individually valid but together impossible."""

    def __init__(self, key, value, message):
        super().__init__(message)
        self.key, self.value = key, value


def _check_contradictions(c: Config):
    def bad(key, message):
        raise ContradictionError(key, getattr(c, key), message)

    if c.dataset_type != "text":  # a path no data source reads would train on other data, unsaid
        for key in ("dataset_path", "tokenizer_path"):
            if getattr(c, key):
                bad(key, f"is set but dataset_type={c.dataset_type} does not read it; set dataset_type=text (or drop {key})")
    if c.checkpoint_device_snapshot and not c.async_checkpointing:
        bad("checkpoint_device_snapshot", "hands the state's copy to Orbax in the background, which async_checkpointing=false forbids; set async_checkpointing=true or checkpoint_device_snapshot=false")
    if c.hf_model_path and c.load_parameters_path:
        bad("hf_model_path", f"and load_parameters_path={c.load_parameters_path!r} both give the parameters; set one")
    for key, (want, why) in DECODER_BLOCKS[c.decoder_block].items():
        if getattr(c, key) != want:
            shown = str(want).lower() if isinstance(want, bool) else want
            bad(key, f"must be {shown} with decoder_block={c.decoder_block} ({why}; decoder_block=custom allows any)")
    if c.decoder_block in _ALL_EXPERT_ROUTING and c.n_routing_groups != -1:
        bad("n_routing_groups", f"group-limited routing is DeepSeek's; {_ALL_EXPERT_ROUTING[c.decoder_block]} (decoder_block={c.decoder_block}) routes over all experts, so set n_routing_groups=-1 and topk_routing_group=-1")
    if c.attention_type == "gqa":
        kv, hd = _kv_heads(c), _head_dim(c)
        if kv < 1 or c.num_query_heads % kv:
            bad("num_kv_heads", f"must divide num_query_heads={c.num_query_heads} (or be -1)")
        if hd < 2 or hd % 2:
            bad("head_dim", f"is {hd}; GQA needs a positive even head dim (rotate-half RoPE)")
        if c.rope_factor != 1:
            bad("rope_factor", "YaRN scaling is implemented for attention_type=mla only; GQA takes rope_factor=1")
    elif c.use_qk_norm:
        bad("use_qk_norm", "applies to attention_type=gqa (MLA has its own latent norms)")
    if c.num_experts_per_tok > c.num_experts:
        bad("num_experts_per_tok", f"must be <= num_experts={c.num_experts}")
    if (c.n_routing_groups == -1) != (c.topk_routing_group == -1):
        bad("topk_routing_group", "n_routing_groups and topk_routing_group must both be set (> 0) or both be -1")
    if c.n_routing_groups != -1:
        if c.n_routing_groups < 1 or c.num_experts % c.n_routing_groups:
            bad("n_routing_groups", f"must divide num_experts={c.num_experts} (or be -1)")
        if not 1 <= c.topk_routing_group <= c.n_routing_groups:
            bad("topk_routing_group", f"must be in [1, n_routing_groups={c.n_routing_groups}]")
        per_group = c.num_experts // c.n_routing_groups
        if c.topk_routing_group * per_group < c.num_experts_per_tok:
            bad("topk_routing_group", f"kept groups hold {c.topk_routing_group * per_group} experts, fewer than num_experts_per_tok={c.num_experts_per_tok}")
    if c.ragged_buffer_factor != -1 and c.ragged_buffer_factor < 1:
        bad("ragged_buffer_factor", "must be -1 (exact worst case) or >= 1.0")
    if c.max_target_length % c.ep_pipeline_chunks:
        bad("ep_pipeline_chunks", f"must divide max_target_length={c.max_target_length} (each rank's tokens split into equal chunks)")
    if c.first_num_dense_layers > c.num_decoder_layers:
        bad("first_num_dense_layers", f"must be <= num_decoder_layers={c.num_decoder_layers}")
    if c.routed_bias_update_rate > 0 and not c.routed_bias:
        bad("routed_bias_update_rate", "is > 0 but routed_bias is false")
    if c.te_gmm_quantization != "te_no_quant" and not c.sparse_matmul:
        bad("te_gmm_quantization", "quantizes grouped GEMMs; sparse_matmul=false (the capacity baseline) has none")
    if c.gmm_fp8_impl == "kernel" and c.te_gmm_quantization != "te_fp8_blockwise":
        bad("gmm_fp8_impl", f"has FP8 kernels for te_gmm_quantization=te_fp8_blockwise only, got te_gmm_quantization={c.te_gmm_quantization}; allowed with it: auto or emulate")
    if c.gmm_fp8_quantizer not in ("auto", "xla") and c.gmm_fp8_impl == "emulate":
        bad("gmm_fp8_quantizer", f"chooses how the FP8 kernels quantize; with gmm_fp8_impl=emulate only auto or xla is allowed")
    if c.gmm_fp8_quantizer == "mosaic" and c.te_gmm_quantization == "te_fp8_blockwise" and c.dtype != "bfloat16":
        bad("gmm_fp8_quantizer", f"mosaic quantizes bfloat16 operands only, got dtype={c.dtype}; set dtype=bfloat16, or gmm_fp8_quantizer=auto (pallas for other dtypes)")
    if c.gmm_fp8_kernel_schedule != "default" and (c.te_gmm_quantization != "te_fp8_blockwise" or c.gmm_fp8_impl == "emulate"):
        bad("gmm_fp8_kernel_schedule", f"schedules the FP8 kernels, which run for te_gmm_quantization=te_fp8_blockwise with gmm_fp8_impl auto or kernel only, got te_gmm_quantization={c.te_gmm_quantization} gmm_fp8_impl={c.gmm_fp8_impl}; allowed here: default")
    if c.gmm_fp8_fused_swiglu and (c.te_gmm_quantization != "te_fp8_blockwise" or c.gmm_fp8_impl == "emulate"):
        bad("gmm_fp8_fused_swiglu", f"fuses SwiGLU into the FP8 kernels' quantizer, which runs for te_gmm_quantization=te_fp8_blockwise with gmm_fp8_impl auto or kernel only, got te_gmm_quantization={c.te_gmm_quantization} gmm_fp8_impl={c.gmm_fp8_impl}; allowed here: false")
    if c.gmm_fp8_fused_swiglu and not c.prefuse_moe_weights:
        bad("gmm_fp8_fused_swiglu", "reads gate|up as one [M, 2F] output, which needs prefuse_moe_weights=true; allowed here: false")
    if c.gmm_fp8_weights_once_per_step and (c.te_gmm_quantization != "te_fp8_blockwise" or c.gmm_fp8_impl == "emulate"):
        bad("gmm_fp8_weights_once_per_step", f"shares the FP8 kernels' weight codes across microbatches; the kernels run for te_gmm_quantization=te_fp8_blockwise with gmm_fp8_impl auto or kernel only, got te_gmm_quantization={c.te_gmm_quantization} gmm_fp8_impl={c.gmm_fp8_impl}; allowed here: false")
    if c.gmm_fp8_impl == "kernel" and c.hardware in ("cpu", "tpu"):
        bad("gmm_fp8_impl", f"runs Mosaic GPU kernels on a Hopper GPU; with hardware={c.hardware} only auto or emulate is allowed")
    if c.gmm_fp8_impl == "kernel":
        bad_dims = {k: getattr(c, k) for k in ("emb_dim", "moe_mlp_dim") if getattr(c, k) % 256}
        if bad_dims:
            dims = ", ".join(f"{k}={v}" for k, v in bad_dims.items())
            bad("gmm_fp8_impl", f"kernels need emb_dim and moe_mlp_dim multiples of 256, got {dims}; allowed with these dims: auto or emulate")
    if c.attention == "cudnn_flash_te" and c.dtype == "float32":
        bad("attention", "cuDNN flash attention takes bfloat16 or float16 activations, got dtype=float32; set dtype=bfloat16 or attention=dot_product")
    if c.cudnn_mla_unpadded_v is True and c.attention != "cudnn_flash_te":
        bad("cudnn_mla_unpadded_v", f"changes how cuDNN flash attention takes v; with attention={c.attention} only auto or false is allowed (true needs attention=cudnn_flash_te)")
    if c.attention == "cudnn_flash_te" and c.hardware in ("cpu", "tpu"):
        bad("attention", f"cuDNN flash attention needs an NVIDIA GPU, got hardware={c.hardware}; allowed there: dot_product")
    if c.gmm_backend == "mosaic" and c.hardware in ("cpu", "tpu"):
        bad("gmm_backend", f"runs Mosaic GPU kernels on a Hopper GPU, got hardware={c.hardware}; allowed there: auto, xla, reference")
    if c.gmm_backend == "mosaic" and c.dtype == "float32":
        bad("gmm_backend", "the Mosaic kernels take bfloat16 or float16, got dtype=float32; set dtype=bfloat16 or gmm_backend=auto")
    if not c.te_moe_block:
        bad("te_moe_block", "dropless has one MoE block (the fused grouped-GEMM one); only true is allowed. For the capacity-based baseline set sparse_matmul=false")
    if c.quantize_output_head and not c.quantization:
        bad("quantize_output_head", "is true but quantization is '' (set quantization=te_fp8_currentscaling)")
    if c.fp8_min_dim < 0:
        bad("fp8_min_dim", "is negative (0 quantizes every dense matmul; a positive size keeps narrower ones in bf16)")
    # Only a value the user gave: the default (4096) is inert without FP8.
    if "fp8_min_dim" in c.model_fields_set and c.quantization != "te_fp8_currentscaling":
        bad("fp8_min_dim", "is set but quantization is '' (set quantization=te_fp8_currentscaling, or leave fp8_min_dim out)")
    if c.fp8_dot_bf16_output and c.quantization != "te_fp8_currentscaling":
        bad("fp8_dot_bf16_output", f"is true but quantization is {c.quantization!r} (set quantization=te_fp8_currentscaling, or leave fp8_dot_bf16_output out)")
    for axis in ("data", "fsdp", "expert", "tensor"):
        for kind in ("ici", "dcn"):
            key = f"{kind}_{axis}_parallelism"
            if getattr(c, key) == 0 or getattr(c, key) < -1:
                bad(key, "must be a positive integer or -1 (fill)")
    for kind in ("ici", "dcn"):
        fills = [a for a in ("data", "fsdp", "expert", "tensor") if getattr(c, f"{kind}_{a}_parallelism") == -1]
        if len(fills) > 1:
            bad(f"{kind}_{fills[1]}_parallelism", f"only one {kind}_*_parallelism may be -1, got {fills}")
    for kind in ("ici", "dcn"):
        if getattr(c, f"{kind}_tensor_parallelism") != 1:
            bad(f"{kind}_tensor_parallelism", "must be 1: no layer is split over a tensor axis, so more ways would only repeat the same work; use ici_fsdp_parallelism or ici_expert_parallelism")
    ep = max(c.ici_expert_parallelism, 1) * max(c.dcn_expert_parallelism, 1)
    if c.num_experts % ep:
        bad("ici_expert_parallelism", f"expert-parallel ways ({ep}) must divide num_experts={c.num_experts}")
    if c.remat_policy != "custom":
        for name in REMAT_TENSORS:
            if getattr(c, name) is not None:
                bad(name, f"is set but remat_policy={c.remat_policy!r}; per-tensor placement needs remat_policy=custom")


def resolve_mesh_shape(c: Config, num_devices: int, num_slices: int = 1) -> dict[str, int]:
    """Fill -1 axes and check the mesh covers exactly ``num_devices``.

    Returns {axis: ways} over data, fsdp, expert, tensor (ICI x DCN).
    Raises ContradictionError naming the key when the product is wrong.
    """
    axes = ("data", "fsdp", "expert", "tensor")
    per_slice = num_devices // num_slices
    shape = {}
    for kind, total in (("ici", per_slice), ("dcn", num_slices)):
        ways = {a: getattr(c, f"{kind}_{a}_parallelism") for a in axes}
        known = math.prod(v for v in ways.values() if v != -1)
        fill = [a for a, v in ways.items() if v == -1]
        if fill:
            if total % known:
                raise ContradictionError(f"{kind}_{fill[0]}_parallelism", -1,
                    f"cannot fill: {total} devices not divisible by the other {kind} axes' product {known}")
            ways[fill[0]] = total // known
        if math.prod(ways.values()) != total:
            key = f"{kind}_{axes[0]}_parallelism"
            raise ContradictionError(key, ways[axes[0]],
                f"{kind} mesh {ways} has {math.prod(ways.values())} devices but {total} are present")
        for a in axes:
            shape[a] = shape.get(a, 1) * ways[a]
    return shape
