"""Runtime problems the user can fix, turned into one-line ``ConfigError``s.

The config layer refuses what it can see in the keys alone. What needs the
machine or the data is checked here, when the trainer starts: the platform
(``hardware=gpu`` with no GPU found, cuDNN attention or the Mosaic kernels
without a Hopper GPU), the data and tokenizer (``data_errors``) and device
memory (``out_of_memory``). The CLI prints a ``ConfigError`` as one line and
exits 2 (``--debug``: the traceback).
"""

import contextlib
import os

import jax

from dropless.config.loader import ConfigError
from dropless.config.sections import ModelConfig, TrainConfig
from dropless.config.xla_flags import GPU_HARDWARE


def check_hardware(hardware: str) -> None:
    """Raises ConfigError for ``hardware=gpu``/``gpu_multiprocess`` when JAX found no GPU."""
    backend = jax.default_backend()
    if hardware not in GPU_HARDWARE or backend == "gpu":
        return
    platforms = os.environ.get("JAX_PLATFORMS", "")
    why = f"JAX_PLATFORMS={platforms!r}" if platforms else "is a CUDA build of jax installed, jax[cuda12] or jax[cuda13]?"
    raise ConfigError(f"hardware={hardware!r} but JAX found no GPU (it runs on {backend}; {why}); "
                      "allowed on this machine: hardware=auto or cpu")


def check_platform(model: ModelConfig) -> None:
    """Refuse kernels this process's default device cannot run.

    Raises:
      ConfigError: attention=cudnn_flash_te off an NVIDIA GPU, or
        gmm_backend=mosaic / gmm_fp8_impl=kernel off a Hopper GPU.
    """
    from dropless.ops.gmm import mosaic

    device = jax.devices()[0]
    where = f"this process's devices are {device.platform} ({device.device_kind})"
    if model.mla.attention == "cudnn_flash_te" and device.platform != "gpu":
        raise ConfigError(f"attention='cudnn_flash_te' needs an NVIDIA GPU (cuDNN) and {where}; "
                          "allowed here: attention=dot_product")
    if not mosaic.is_available():
        if model.moe.gmm_backend == "mosaic":
            raise ConfigError(f"gmm_backend='mosaic' runs Mosaic GPU kernels on a Hopper (sm_90) GPU "
                              f"and {where}; allowed here: auto, xla, reference")
        if model.moe.gmm_fp8_impl == "kernel" and model.moe.gmm_quantization == "te_fp8_blockwise":
            raise ConfigError(f"gmm_fp8_impl='kernel' runs FP8 Mosaic GPU kernels on a Hopper (sm_90) "
                              f"GPU and {where}; allowed here: emulate")


@contextlib.contextmanager
def data_errors():
    """Re-raise the data source's ValueError / OSError (paths, files, tokenizer) as ConfigError."""
    try:
        yield
    except (ValueError, OSError) as e:
        raise ConfigError(f"data: {e}") from e


def is_out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, jax.errors.JaxRuntimeError) and (
        "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower())


def out_of_memory_message(e: BaseException, model: ModelConfig, train: TrainConfig) -> str:
    """One line: what ran out, and the keys that lower memory with their current values."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:200]
    keys = [f"per_device_batch_size={train.per_device_batch_size:g} (raise "
            f"gradient_accumulation_steps={train.gradient_accumulation_steps} to keep the batch)",
            f"max_target_length={train.max_target_length}"]
    if model.remat_policy != "full":
        keys.append(f"remat_policy={model.remat_policy} (full keeps the least)")
    if model.mla.attention == "dot_product":
        keys.append("attention=dot_product (cudnn_flash_te holds no score matrix)")
    return f"out of device memory ({first}); lower {', '.join(keys)}, or shard over more devices"


@contextlib.contextmanager
def memory_errors(model: ModelConfig, train: TrainConfig):
    """Re-raise an XLA out-of-memory error (at compile or run time) as one-line ConfigError."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if is_out_of_memory(e):
            raise ConfigError(out_of_memory_message(e, model, train)) from e
        raise
