"""Hugging Face checkpoints in and out.

``load.load_hf`` reads a local Hugging Face directory (config.json +
safetensors) into dropless's parameters, streaming one tensor region at a
time into each process's shards; ``export.write_hf`` writes parameters as
such a directory. The tensor names of each architecture live in their own
module (``deepseek_v3``, ``qwen3_moe``, ``mixtral``, built from ``leaves``), registered in
``ARCHITECTURES`` by config.json's ``model_type``; its config.json keys are
read and written by ``config.hf_config``.
"""

from dropless.hf import deepseek_v3, mixtral, qwen3_moe

ARCHITECTURES = {arch.MODEL_TYPE: arch for arch in (deepseek_v3, qwen3_moe, mixtral)}


def architecture_of(cfg):
    """The architecture module that writes ``cfg``'s model (``sections.ModelConfig``),
    by the attention it describes (each module's ``writes``): MLA as
    DeepSeek-V3, GQA with q/k norm as Qwen3-MoE, GQA without as Mixtral.

    Raises:
      ValueError: an attention type no architecture has.
    """
    for arch in ARCHITECTURES.values():
        if arch.writes(cfg):
            return arch
    raise ValueError(f"attention_type={cfg.attention_type!r} has no Hugging Face architecture")
