"""What the Hugging Face fixture generators (``make_hf_fixture.py``,
``make_hf_fixture_qwen3.py``, ``make_hf_fixture_mixtral.py``) share: random
bf16-representable weights, transformers' logits and routed experts, the
published per-expert tensor names, and the files every fixture directory holds.

Imported by those scripts (run from this folder's parent as
``python3 tools/make_hf_fixture*.py OUT``; Python puts ``tools/`` on the path).
Needs torch, transformers >= 5 and safetensors, not dropless's environment.
"""

import argparse
import json
import os
import platform

import numpy as np
import safetensors
import torch
import transformers
from safetensors.torch import save_file


def out_dir(argv, description: str) -> str:
    """The command line's one argument OUT, the fixture directory, created."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out")
    out = ap.parse_args(argv).out
    os.makedirs(out, exist_ok=True)
    return out


def random_tokens(seed: int, vocab_size: int, batch: int, seq: int) -> np.ndarray:
    """int32 [batch, seq] tokens drawn uniformly by numpy's generator of ``seed``."""
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, seq)).astype(np.int32)


def random_model(config_cls, model_cls, hf_config: dict, rope_parameters: dict, seed: int):
    """``model_cls(config_cls(**hf_config, rope_parameters=..., eager attention))`` in
    float32 eval mode, built after ``torch.manual_seed(seed)`` and then randomized by
    ``randomize_bf16`` with std ``hf_config["initializer_range"]``."""
    torch.manual_seed(seed)
    cfg = config_cls(**hf_config, rope_parameters=rope_parameters, attn_implementation="eager")
    model = model_cls(cfg).float().eval()
    randomize_bf16(model, hf_config["initializer_range"])
    return model


def randomize_bf16(model, std: float) -> None:
    """Sets every parameter of ``model`` in place from torch's global generator,
    in ``named_parameters`` order: RMSNorm weights 1 + 0.2 N(0, 1) (away from 1,
    so a norm applied without its weight shows), the rest std N(0, 1); each
    rounded to a bfloat16 value, so bf16 files then hold the model exactly."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
            p.copy_(p.bfloat16().float())


def run(model, tokens, router: str):
    """(logits [B, S, V] float32, experts [L_moe, B*S, K] int32 sorted per token).

    ``router``: the class name of the model's router module, whose output
    ``[2]`` is the chosen experts [B*S, K].
    """
    experts = []

    def hook(_module, _inputs, outputs):
        experts.append(torch.sort(outputs[2], dim=-1).values.to(torch.int32).numpy())

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ == router]
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    for h in handles:
        h.remove()
    return logits, np.stack(experts)


def routing_margin(model, tokens, router: str) -> float:
    """Smallest gap between the k-th and (k+1)-th router probability of any token and
    layer, ``router`` a softmax router class whose output ``[0]`` is the logits."""
    gaps = []

    def hook(module, _inputs, outputs):
        probs = torch.softmax(outputs[0].float(), dim=-1)
        top = torch.topk(probs, module.top_k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ == router]
    with torch.no_grad():
        model(torch.from_numpy(tokens).long())
    for h in handles:
        h.remove()
    return min(gaps)


def published_tensors(state: dict, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> dict:
    """transformers 5's state_dict -> per-expert names: the fused
    ``experts.gate_up_proj`` [E, 2F, D] becomes ``experts.N.{gate}.weight`` and
    ``experts.N.{up}.weight``, ``experts.down_proj`` [E, D, F] ``experts.N.{down}.weight``;
    the rest as it is."""
    out = {}
    for name, t in state.items():
        if name.endswith(".experts.gate_up_proj"):
            base, f = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.{gate}.weight"] = t[e, :f]
                out[f"{base}{e}.{up}.weight"] = t[e, f:]
        elif name.endswith(".experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.{down}.weight"] = t[e]
        else:
            out[name] = t
    return out


def save_sharded(tensors: dict, out: str, shards: int) -> None:
    """``tensors`` in ``shards`` safetensors files (names dealt round-robin) + index."""
    os.makedirs(out, exist_ok=True)
    names = sorted(tensors)
    weight_map, total = {}, 0
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(out, fname), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1, sort_keys=True)


def write_fused(out: str, model, tensors: dict) -> None:
    """``out/fused``: transformers 5's config.json of ``model`` and ``tensors`` in one file."""
    os.makedirs(os.path.join(out, "fused"), exist_ok=True)
    model.config.to_json_file(os.path.join(out, "fused", "config.json"))
    save_file(tensors, os.path.join(out, "fused", "model.safetensors"), metadata={"format": "pt"})


def write_published(path: str, tensors: dict, config: dict, shards: int) -> None:
    """A published-layout directory: ``tensors`` sharded + index, and ``config`` as config.json."""
    save_sharded(tensors, path, shards)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)


def write_outputs(out: str, tokens, logits, experts) -> None:
    """tokens.npy (int32 [B, S]), logits.npy (float32 [B, S, V]), experts.npy (int32)."""
    np.save(os.path.join(out, "tokens.npy"), tokens)
    np.save(os.path.join(out, "logits.npy"), logits.astype(np.float32))
    np.save(os.path.join(out, "experts.npy"), experts)


def meta(generator: str, seed: int, batch: int, seq: int, hf_config: dict, rope: dict, **extra) -> dict:
    """meta.json's record: the generator and its inputs, the library versions, the
    config (``rope``: its RoPE entries), then ``extra``."""
    return {
        "generator": generator, "seed": seed, "batch": batch, "seq": seq,
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "safetensors": safetensors.__version__,
        "numpy": np.__version__, "hf_config": hf_config, **rope,
        "attn_implementation": "eager", "dtype": "float32 compute, bf16-representable weights",
        **extra,
    }


def write_meta(out: str, record: dict) -> int:
    """``out/meta.json``; returns the bytes now under ``out``."""
    with open(os.path.join(out, "meta.json"), "w") as fh:
        json.dump(record, fh, indent=1)
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(out) for n in ns)
