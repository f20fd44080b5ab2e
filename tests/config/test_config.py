"""Config resolution, precedence, the seed recipe, XLA flags and bad input."""

import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from dropless.config.loader import ConfigError, available_models, load_config
from dropless.config.schema import Config, resolve_mesh_shape
from dropless.config.xla_flags import (GPU_DEFAULTS, apply_runtime_settings, check_xla_flags, format_flag,
                                      known_xla_flags)

HERE = Path(__file__).parent
SEED = HERE / "seed_recipe.yml"


def resolve(*overrides, config_file=None, environ=None):
    return load_config(config_file and str(config_file), list(overrides), environ=environ or {})


def test_every_model_resolves():
    for name in available_models():
        cfg = resolve(f"model_name={name}").config
        model = cfg.model()
        assert model.moe.num_experts == cfg.num_experts
        assert model.mla.num_heads == cfg.num_query_heads


def test_deepseek3_671b_preset_matches_the_paper():
    cfg = resolve("model_name=deepseek3-671b").config
    assert (cfg.num_decoder_layers, cfg.first_num_dense_layers, cfg.emb_dim) == (61, 3, 7168)
    assert (cfg.num_query_heads, cfg.mlp_dim, cfg.moe_mlp_dim) == (128, 18432, 2048)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.shared_experts) == (256, 8, 1)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (1536, 512, 128, 64, 128)
    assert cfg.routed_scaling_factor == 2.5 and cfg.routed_score_func == "sigmoid"
    assert cfg.vocab_size == 129280


def test_proxy_has_v3_layer_shapes():
    cfg = resolve("model_name=deepseek3-proxy").config
    assert (cfg.emb_dim, cfg.moe_mlp_dim, cfg.num_experts, cfg.num_experts_per_tok) == (7168, 2048, 32, 8)
    assert cfg.num_decoder_layers - cfg.first_num_dense_layers == 3


def test_precedence_base_model_file_cli_env(tmp_path):
    user = tmp_path / "job.yml"
    user.write_text("steps: 7\nemb_dim: 96\nlearning_rate: 0.01\n")
    r = resolve("steps=9", config_file=user, environ={"DROPLESS_LEARNING_RATE": "0.02"})
    assert r.config.steps == 9 and r.source("steps") == "command line"
    assert r.config.emb_dim == 96 and r.source("emb_dim") == str(user)
    assert r.config.learning_rate == 0.02 and r.source("learning_rate") == "environment"
    assert r.source("num_experts") == "models/deepseek3-tiny.yml"
    assert r.source("adam_b1") == "default"


def test_seed_recipe_loads_verbatim_with_tiny_model():
    # The recipe's cuDNN attention needs bf16 activations; the tiny preset's are float32.
    r = resolve("model_name=deepseek3-tiny", "dtype=bfloat16", config_file=SEED)
    cfg = r.config
    assert cfg.model_name == "deepseek3-tiny" and cfg.emb_dim == 64
    assert cfg.te_gmm_quantization == "te_mxfp8" and cfg.quantization == "te_fp8_currentscaling"
    assert cfg.ragged_buffer_factor == 2.0 and cfg.mesh().ep_overflow_check_every_n_steps == 20
    assert cfg.weight_dtype == cfg.mu_dtype == "bfloat16"
    assert cfg.xla_flags["xla_gpu_all_gather_combine_threshold_bytes"] == 6442450944
    assert cfg.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.88"
    assert cfg.env["XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE"] == "false"
    assert r.source("xla_gpu_memory_limit_slop_factor") == str(SEED)


def test_seed_recipe_loads_as_is():
    cfg = resolve(config_file=SEED).config
    assert cfg.model_name == "deepseek3-671b" and cfg.num_experts == 256 and cfg.steps == 15


def test_seed_xla_flags_are_known_to_jaxlib():
    cfg = resolve(config_file=SEED).config
    check_xla_flags(cfg.xla_flags)  # raises on an unknown flag
    assert "xla_gpu_enable_command_buffer" in known_xla_flags()


def test_flag_formatting_strips_shell_quotes():
    assert format_flag("xla_gpu_enable_command_buffer", "'FUSION,CUBLAS'") == "--xla_gpu_enable_command_buffer=FUSION,CUBLAS"
    assert format_flag("xla_x", False) == "--xla_x=false"


def test_flags_applied_only_on_gpu(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    flags = {"xla_gpu_experimental_max_unroll_factor": 8}
    assert apply_runtime_settings(flags, {"DL_CONFIG_TEST_ENV": "1"}, on_gpu=False) == []
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    assert os.environ.pop("DL_CONFIG_TEST_ENV") == "1"
    applied = apply_runtime_settings(flags, {}, on_gpu=True)
    assert applied == ["--xla_gpu_enable_latency_hiding_scheduler=true",
                       "--xla_gpu_experimental_max_unroll_factor=8"]
    assert os.environ["XLA_FLAGS"] == " ".join(["--xla_dump_to=/tmp/x", *applied])


def test_gpu_defaults_yield_to_the_config_and_to_xla_flags(monkeypatch):
    """The latency-hiding scheduler is on by default on a GPU; a config that sets the flag
    (here to false) decides, and so does an XLA_FLAGS that names it, from the shell or from
    the config's environment, with or without a value. Not applied off the GPU."""
    lhs = "xla_gpu_enable_latency_hiding_scheduler"
    assert set(GPU_DEFAULTS) == {lhs}
    monkeypatch.setenv("XLA_FLAGS", "")
    assert apply_runtime_settings({}, {}, on_gpu=False) == []
    assert apply_runtime_settings({}, {}, on_gpu=True) == [f"--{lhs}=true"]
    monkeypatch.setenv("XLA_FLAGS", "")
    assert apply_runtime_settings({lhs: False}, {}, on_gpu=True) == [f"--{lhs}=false"]
    for given in (f"--{lhs}=false", f"--xla_dump_to=/tmp/x --{lhs}", f"--{lhs} --xla_dump_to=/tmp/x"):
        monkeypatch.setenv("XLA_FLAGS", given)
        assert apply_runtime_settings({}, {}, on_gpu=True) == []
        assert os.environ["XLA_FLAGS"] == given
        monkeypatch.setenv("XLA_FLAGS", "")
        assert apply_runtime_settings({}, {"XLA_FLAGS": given}, on_gpu=True) == []
    # A flag whose name only begins with the default's is not the default.
    monkeypatch.setenv("XLA_FLAGS", f"--{lhs}_x=1")
    assert apply_runtime_settings({}, {}, on_gpu=True) == [f"--{lhs}=true"]


def test_sections_are_frozen():
    import dataclasses

    cfg = resolve().config
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.moe().num_experts = 3
    with pytest.raises(Exception):
        cfg.steps = 3


def test_custom_remat_settings_reach_the_model_section():
    cfg = resolve("remat_policy=custom", "query_proj=offload", "mla_kv=device").config
    assert dict(cfg.model().remat_custom) == {"query_proj": "offload", "mla_kv": "device"}


@pytest.mark.parametrize("devices,overrides,expect", [
    (8, [], {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}),
    (8, ["ici_expert_parallelism=4"], {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1}),
    (8, ["ici_data_parallelism=2", "ici_expert_parallelism=4", "ici_fsdp_parallelism=1"], {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}),
])
def test_mesh_resolution(devices, overrides, expect):
    assert resolve_mesh_shape(resolve(*overrides).config, devices) == expect


BAD = [
    (["num_expert=4"], "did you mean 'num_experts'"),
    (["num_experts_per_tok=9"], "num_experts_per_tok=9"),
    (["num_experts_per_tok=0"], "greater than or equal to 1"),
    (["n_routing_groups=3"], "must divide num_experts"),
    (["n_routing_groups=4", "topk_routing_group=-1"], "both be set"),
    (["topk_routing_group=5"], "topk_routing_group=5"),
    (["ragged_buffer_factor=0.5"], "must be -1 (exact worst case) or >= 1.0"),
    (["ep_pipeline_chunks=3", "max_target_length=128"], "ep_pipeline_chunks=3 (from command line): must divide max_target_length=128"),
    (["ep_pipeline_chunks=0"], "greater than or equal to 1"),
    (["routed_score_func=relu"], "'softmax' or 'sigmoid'"),
    (["model_name=deepseek3-tinyy"], "did you mean 'deepseek3-tiny'"),
    (["steps=0"], "steps=0"),
    (["steps=ten"], "steps='ten'"),
    (["dtype=float8"], "dtype='float8'"),
    (["gmm_backend=cuda"], "'reference', 'xla', 'mosaic' or 'auto'"),
    (["te_gmm_quantization=fp4"], "te_gmm_quantization='fp4'"),
    (["remat_policy=sometimes"], "remat_policy='sometimes'"),
    (["query_proj=offload"], "needs remat_policy=custom"),
    (["remat_policy=custom", "query_proj=disk"], "query_proj='disk'"),
    (["first_num_dense_layers=9"], "must be <= num_decoder_layers"),
    (["ici_expert_parallelism=3"], "must divide num_experts"),
    (["ici_data_parallelism=-1"], "only one ici_*_parallelism may be -1"),
    (["ici_tensor_parallelism=0"], "positive integer or -1"),
    (["routed_bias=false", "routed_bias_update_rate=0.1"], "routed_bias is false"),
    (["sparse_matmul=false", "te_gmm_quantization=te_mxfp8"], "capacity baseline"),
    (["quantize_output_head=true"], "quantize_output_head"),
    (["checkpoint_device_snapshot=true", "async_checkpointing=false"],
     "checkpoint_device_snapshot=True (from command line): hands the state's copy to Orbax in the background"),
    (["fp8_pow2_scales=true"], "unknown key 'fp8_pow2_scales' (from command line)"),
    (["fp8_min_dim=4096"], "fp8_min_dim=4096 (from command line): is set but quantization is ''"),
    (["fp8_min_dim=0"], "fp8_min_dim=0 (from command line): is set but quantization is ''"),
    (["quantization=te_fp8_currentscaling", "fp8_min_dim=-1"], "fp8_min_dim=-1 (from command line): is negative"),
    (["fp8_dot_bf16_output=true"], "fp8_dot_bf16_output=True (from command line): is true but quantization is ''"),
    (["gmm_fp8_impl=kernel"], "gmm_fp8_impl='kernel' (from command line): has FP8 kernels for te_gmm_quantization=te_fp8_blockwise only"),
    (["te_gmm_quantization=te_mxfp8", "gmm_fp8_impl=kernel"], "got te_gmm_quantization=te_mxfp8; allowed with it: auto or emulate"),
    (["te_gmm_quantization=te_fp8_blockwise", "gmm_fp8_impl=kernel", "hardware=cpu"], "with hardware=cpu only auto or emulate is allowed"),
    (["gmm_fp8_impl=native"], "'auto', 'emulate' or 'kernel'"),
    (["te_gmm_quantization=te_fp8_blockwise", "gmm_fp8_impl=emulate", "gmm_fp8_quantizer=pallas"],
     "with gmm_fp8_impl=emulate only auto or xla is allowed"),
    (["te_gmm_quantization=te_fp8_blockwise", "gmm_fp8_impl=emulate", "gmm_fp8_quantizer=mosaic"],
     "with gmm_fp8_impl=emulate only auto or xla is allowed"),
    (["te_gmm_quantization=te_fp8_blockwise", "gmm_fp8_quantizer=mosaic", "dtype=float32"],
     "mosaic quantizes bfloat16 operands only, got dtype=float32; set dtype=bfloat16, or gmm_fp8_quantizer=auto"),
    (["gmm_fp8_kernel_schedule=halves_unfenced"],
     "gmm_fp8_kernel_schedule='halves_unfenced' (from command line): schedules the FP8 kernels, which run for te_gmm_quantization=te_fp8_blockwise"),
    (["te_gmm_quantization=te_fp8_blockwise", "gmm_fp8_impl=emulate", "gmm_fp8_kernel_schedule=halves_unfenced"],
     "got te_gmm_quantization=te_fp8_blockwise gmm_fp8_impl=emulate; allowed here: default"),
    (["gmm_fp8_weights_once_per_step=true"],
     "gmm_fp8_weights_once_per_step=True (from command line): shares the FP8 kernels' weight codes across microbatches"),
    (["te_gmm_quantization=te_fp8_blockwise", "gmm_fp8_impl=emulate", "gmm_fp8_weights_once_per_step=true"],
     "allowed here: false"),
    (["gmm_fp8_fused_swiglu=true"],
     "gmm_fp8_fused_swiglu=True (from command line): fuses SwiGLU into the FP8 kernels' quantizer"),
    (["te_gmm_quantization=te_fp8_blockwise", "prefuse_moe_weights=false", "gmm_fp8_fused_swiglu=true"],
     "needs prefuse_moe_weights=true; allowed here: false"),
    (["gmm_fp8_kernel_schedule=quarters"],
     "'default', 'narrow', 'halves_unfenced', 'p96_32_unfenced', 'xhalves_unfenced', 'wide_o192', 'wide_n160', "
     "'wide_n192', 'wide_o192_n160', 'wide_o192_n192' or 'wide_o192_n160_under'"),
    (["te_gmm_quantization=te_fp8_blockwise", "gmm_fp8_impl=kernel", "emb_dim=256", "moe_mlp_dim=200"],
     "kernels need emb_dim and moe_mlp_dim multiples of 256, got moe_mlp_dim=200"),
    (["attention=cudnn_flash_te", "dtype=float32"], "got dtype=float32; set dtype=bfloat16 or attention=dot_product"),
    (["attention=cudnn_flash_te", "dtype=bfloat16", "hardware=cpu"], "needs an NVIDIA GPU, got hardware=cpu"),
    (["gmm_backend=mosaic", "hardware=cpu"], "gmm_backend='mosaic' (from command line): runs Mosaic GPU kernels"),
    (["gmm_backend=mosaic", "dtype=float32"], "set dtype=bfloat16 or gmm_backend=auto"),
    (["te_moe_block=false"], "te_moe_block=False (from command line): dropless has one MoE block"),
    (["ici_tensor_parallelism=2"], "ici_tensor_parallelism=2 (from command line): must be 1"),
    (["ici_tensor_parallelism=-1", "ici_fsdp_parallelism=1"], "ici_tensor_parallelism=-1"),
    (["dcn_tensor_parallelism=2"], "dcn_tensor_parallelism=2"),
    (["markov_successors=0"], "markov_successors=0"),
    (["learning_rate=-1"], "learning_rate=-1"),
    (["adam_b2=1.5"], "adam_b2=1.5"),
    (["steps"], "is not key=value"),
    (["zzzqqq=1"], "unknown key 'zzzqqq' (from command line); run 'dropless config --keys' to list the keys"),
    (["dataset_type=imagenet"], "'synthetic', 'markov' or 'text'"),
    # A path the data source would not read: training on Markov data instead is a silent downgrade.
    (["dataset_path=tokens.npy"], "dataset_path='tokens.npy' (from command line): is set but dataset_type=markov does not read it; set dataset_type=text"),
    (["dataset_type=synthetic", "tokenizer_path=tok.json"], "tokenizer_path='tok.json' (from command line): is set but dataset_type=synthetic"),
    (["hardware=abacus"], "hardware='abacus'"),
    (["ep_overflow_policy=ignore"], "'error' or 'warn'"),
    (["xla_gpu_not_a_real_flag_at_all=1"], "not an XLA flag"),
    # auto | true | false keys name all three, not only the literal.
    (["checkpoint_warm_host_memory=maybe"], "checkpoint_warm_host_memory='maybe' (from command line): must be one of 'auto', true or false"),
    (["cudnn_mla_unpadded_v=2"], "must be one of 'auto', true or false"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_gives_one_clear_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        r = resolve(*overrides)
        check_xla_flags(r.config.xla_flags)
    text = str(err.value)
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize("quantizer", ["pallas", "mosaic"])
def test_gmm_fp8_impl_and_quantizer_reach_the_grouped_gemms(monkeypatch, quantizer):
    """The key goes config -> MoEConfig -> MoEBlock -> both quantized.gmm calls."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dropless.nn import moe
    from dropless.ops.gmm import quantized

    allowed = typing.get_args(Config.model_fields["gmm_fp8_kernel_schedule"].annotation)
    assert allowed == tuple(quantized.KERNEL_SCHEDULES)  # the key offers exactly the schedules
    default = resolve("te_gmm_quantization=te_fp8_blockwise").config.moe()
    assert (default.gmm_fp8_impl, default.gmm_fp8_quantizer, default.gmm_fp8_kernel_schedule) == (
        "auto", "auto", "default")
    section = resolve("te_gmm_quantization=te_fp8_blockwise", "gmm_fp8_impl=kernel", "emb_dim=256",
                      "moe_mlp_dim=256", "num_experts=4", "num_experts_per_tok=2",
                      "gmm_backend=xla", "dtype=bfloat16", f"gmm_fp8_quantizer={quantizer}",
                      "gmm_fp8_kernel_schedule=halves_unfenced").config.moe()
    assert section.gmm_fp8_impl == "kernel" and section.gmm_fp8_quantizer == quantizer
    seen, real_gmm = [], quantized.gmm

    def recording_gmm(x, w, group_sizes, **kw):  # records, then runs the emulation (CPU)
        seen.append((kw["impl"], kw["quant_impl"], kw["kernel_schedule"]))
        return real_gmm(x, w, group_sizes, **dict(kw, impl="emulate"))

    monkeypatch.setattr(quantized, "gmm", recording_gmm)
    block = moe.MoEBlock(section, emb_dim=32, rngs=nnx.Rngs(0))
    jax.eval_shape(lambda x: block(x)[0], jax.ShapeDtypeStruct((1, 8, 32), jnp.float32))
    assert seen == [("kernel", quantizer, "halves_unfenced")] * 2
    with pytest.raises(ValueError, match="gmm_fp8_impl"):
        moe.MoEBlock(dataclasses.replace(section, gmm_quantization="te_mxfp8"), emb_dim=32,
                     rngs=nnx.Rngs(0))


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        resolve(config_file=tmp_path / "missing.yml")
    broken = tmp_path / "broken.yml"
    broken.write_text("steps: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        resolve(config_file=broken)
    listy = tmp_path / "list.yml"
    listy.write_text("- steps\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        resolve(config_file=listy)
    unknown = tmp_path / "unknown.yml"
    unknown.write_text("stepz: 3\n")
    with pytest.raises(ConfigError, match=f"unknown key 'stepz' \\(from {unknown}\\); did you mean 'steps'"):
        resolve(config_file=unknown)


def test_fp8_min_dim_default_is_inert_without_fp8_and_checked_when_set(tmp_path):
    """The default (4096) validates without FP8 and applies with it; a value the user gives
    without quantization=te_fp8_currentscaling is refused, from any source; a recipe file
    with the removed fp8_pow2_scales gets the unknown-key error."""
    assert resolve().config.fp8_min_dim == 4096 and resolve().config.quantization == ""
    fp8 = resolve("quantization=te_fp8_currentscaling").config
    assert fp8.fp8_min_dim == fp8.model().fp8_min_dim == 4096
    assert resolve("quantization=te_fp8_currentscaling", "fp8_min_dim=0").config.model().fp8_min_dim == 0
    assert not resolve("quantization=te_fp8_currentscaling").config.model().fp8_dot_bf16_output
    assert resolve("quantization=te_fp8_currentscaling",
                   "fp8_dot_bf16_output=true").config.model().fp8_dot_bf16_output
    with pytest.raises(ConfigError, match="fp8_min_dim=4096 \\(from environment\\): is set but"):
        resolve(environ={"DROPLESS_FP8_MIN_DIM": "4096"})
    recipe = tmp_path / "recipe.yml"
    recipe.write_text("quantization: te_fp8_currentscaling\nfp8_pow2_scales: true\n")
    with pytest.raises(ConfigError, match=f"unknown key 'fp8_pow2_scales' \\(from {recipe}\\)"):
        resolve(config_file=recipe)


def test_bad_env_var():
    with pytest.raises(ConfigError, match="DROPLESS_STEPZ names no config key; did you mean DROPLESS_STEPS"):
        resolve(environ={"DROPLESS_STEPZ": "3"})


def test_test_and_benchmark_variables_are_not_config_keys():
    environ = {"DROPLESS_SLOW": "1", "DROPLESS_CPU_DEVICES": "8", "DROPLESS_COMMIT": "abc123"}
    assert resolve(environ=environ).config == resolve(environ={}).config


def test_numeric_names_are_text():
    cfg = resolve("run_name=123", "base_output_directory=2026").config
    assert cfg.run_name == "123" and cfg.base_output_directory == "2026"
    with pytest.raises(ConfigError, match="steps='ten'"):  # numbers stay numbers where they must be
        resolve("steps=ten")


def test_section_defaults_are_the_schema_defaults():
    """Sections built directly (tests, benchmarks) mean what the default config means."""
    from dropless.config import sections

    cfg = Config()
    assert cfg.model() == sections.ModelConfig() and cfg.train() == sections.TrainConfig()
    assert cfg.mesh() == sections.MeshConfig()


def test_mesh_product_mismatch():
    cfg = resolve("ici_fsdp_parallelism=2", "ici_expert_parallelism=2").config
    with pytest.raises(ValueError, match="has 4 devices but 8 are present"):
        resolve_mesh_shape(cfg, 8)


def test_cli_bad_input_exits_2_and_runs_nothing(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "dropless", "train", "num_experts=3", f"base_output_directory={tmp_path}"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_experts" in lines[0]
    assert not any(tmp_path.iterdir())


def test_cli_config_prints_sources():
    env = dict(os.environ, JAX_PLATFORMS="cpu", COLUMNS="200")
    proc = subprocess.run([sys.executable, "-m", "dropless", "config", str(SEED), "model_name=deepseek3-tiny",
                           "dtype=bfloat16"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "command line" in proc.stdout and "XLA flag" in proc.stdout and "seed_recipe.yml" in proc.stdout


def test_every_key_has_a_description():
    missing = [k for k, f in Config.model_fields.items() if not f.description]
    assert not missing


def test_moe_group_alignment_reaches_the_moe_block():
    """``moe_group_alignment`` is the MoE section's ``group_alignment`` (1 by default; the
    FP8 recipes raise it further in ``nn.moe.group_alignment``); 0 and past 1024 are refused."""
    from dropless.nn import moe

    assert resolve().config.moe().group_alignment == 1
    section = resolve("moe_group_alignment=64").config.moe()
    assert section.group_alignment == 64 and moe.group_alignment(section) == 64
    fp8 = resolve("moe_group_alignment=64", "te_gmm_quantization=te_fp8_blockwise").config.moe()
    assert moe.group_alignment(fp8) == 128
    for bad in ("0", "2048"):
        with pytest.raises(ConfigError, match="moe_group_alignment"):
            resolve(f"moe_group_alignment={bad}")
