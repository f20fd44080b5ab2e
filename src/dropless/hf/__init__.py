"""Hugging Face checkpoints in and out.

``load.load_hf`` reads a local Hugging Face directory (config.json +
safetensors) into dropless's parameters, streaming one tensor region at a
time into each process's shards; ``export.write_hf`` writes parameters as
such a directory. The tensor names of each architecture live in their own
module (``deepseek_v3``), registered in ``ARCHITECTURES`` by config.json's
``model_type``; its config.json keys are read by ``config.hf_config``.
"""

from dropless.hf import deepseek_v3

ARCHITECTURES = {deepseek_v3.MODEL_TYPE: deepseek_v3}
