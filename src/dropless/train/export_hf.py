"""``dropless export-hf``: a dropless checkpoint as a Hugging Face directory.

    python -m dropless export-hf CKPT --out DIR [--dtype bfloat16|float32]
                                 [--max-shard-gb 5] [config.yml] [key=value ...]

CKPT is a checkpoint step directory (``<run>/checkpoints/<step>``). The model
config is the run's ``config.json`` (written by ``dropless train``), or the
given config file and keys when there are any. DIR receives the published
layout of the model's architecture (``hf.export``: MLA models as DeepSeek-V3,
GQA models as Qwen3-MoE): config.json and sharded safetensors with
an index, loadable by transformers and by ``hf_model_path``. Runs on the
host's CPU (the checkpoint is restored into host memory, so the host needs
the model's size in memory).
"""

import argparse
import dataclasses
import os
import sys

from dropless.config.loader import ConfigError


def parse_args(args: list[str]):
    from dropless.cli import CONFIG_ARGS_HELP

    parser = argparse.ArgumentParser(
        prog="dropless export-hf", description=__doc__.splitlines()[0],
        usage="dropless export-hf CKPT --out DIR [--dtype D] [--max-shard-gb G] [config.yml] [key=value ...]",
        epilog="The model's config is the run's config.json above CKPT, or config.yml and key=value "
               f"when given. {CONFIG_ARGS_HELP}")
    parser.add_argument("checkpoint", help="checkpoint step directory, e.g. runs/x/checkpoints/100")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="dtype of the written tensors (default bfloat16). bfloat16 rounds float32 "
                             "weights to nearest (DeepSeek-V3's router and its bias stay float32); on a small "
                             "briefly trained model that can flip routing choices and move logits visibly. "
                             "float32 round-trips bit for bit")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="largest shard (GB, default 5)")
    ns, rest = parser.parse_known_args(args)
    unknown = [a for a in rest if a.startswith("--")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if ns.max_shard_gb <= 0:
        parser.error("--max-shard-gb must be > 0")
    return ns, rest


def model_config_of_run(checkpoint: str):
    """The ``sections.ModelConfig`` the run above ``checkpoint`` has now: its config.json
    with the changes logged on resume (``run_dir.recorded_config``).

    Raises:
      ConfigError: no run config.json found.
    """
    from flax import traverse_util

    from dropless.config import sections
    from dropless.train import run_dir as run_dir_lib

    path = os.path.abspath(checkpoint.rstrip("/"))
    for up in (2, 3):  # <run>/checkpoints/<step>[/model]
        run_dir = path
        for _ in range(up):
            run_dir = os.path.dirname(run_dir)
        flat = run_dir_lib.recorded_config(run_dir)
        if flat is not None:
            model = traverse_util.unflatten_dict(
                {k.partition(".")[2]: v for k, v in flat.items() if k.startswith("model.")}, sep=".")
            model["mla"] = sections.MLAConfig(**model["mla"])
            model["gqa"] = sections.GQAConfig(**model.get("gqa", {}))
            model["moe"] = sections.MoEConfig(**model["moe"])
            model["remat_custom"] = tuple(tuple(x) for x in model.get("remat_custom", ()))
            return sections.ModelConfig(**model)
    raise ConfigError(f"{checkpoint}: no run config.json above it; give the model's config file or keys")


def main(args: list[str]) -> int:
    """Entry point of ``dropless export-hf``; returns the exit code."""
    ns, rest = parse_args(args)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if rest:
        from dropless.cli import resolve_args

        model_cfg = resolve_args(rest).config.model()
    else:
        model_cfg = model_config_of_run(ns.checkpoint)
    if not os.path.isdir(ns.checkpoint):
        raise ConfigError(f"{ns.checkpoint}: no such checkpoint directory")
    from flax import nnx

    from dropless.config.hf_config import HFConfigError
    from dropless.hf.export import precision_note, write_hf
    from dropless.train import checkpoint as ckpt_lib
    from dropless.train import step as step_lib

    # One device and no expert parallelism: a plain restore into host memory.
    model_cfg = dataclasses.replace(model_cfg, remat_policy="none")
    abstract_model = nnx.eval_shape(lambda: step_lib.build_model(model_cfg, 0))
    _, params, bias, _ = step_lib.split_model(abstract_model)
    abstract = {"params": params, "router_bias": bias}
    import jax

    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
    try:
        state = ckpt_lib.load_parameters(ns.checkpoint, abstract, shardings)
        index = write_hf(state, model_cfg, ns.out, dtype=ns.dtype,
                         max_shard_bytes=int(ns.max_shard_gb * 2**30))
        note = precision_note(state, model_cfg, ns.dtype)  # after write_hf has checked the architecture
    except (ckpt_lib.CheckpointError, HFConfigError) as e:
        print(f"dropless: {e}", file=sys.stderr)
        return 2
    if note:
        print(note)
    files = sorted(set(index["weight_map"].values()))
    print(f"wrote {ns.out}: {len(index['weight_map'])} tensors, "
          f"{index['metadata']['total_size'] / 1e9:.3f} GB in {len(files)} file(s), {ns.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
