"""``dropless forward``: next-token logits of a trained or Hugging Face model.

    python -m dropless forward [config.yml] key=value ... --tokens TOKENS.npy --out LOGITS.npy

TOKENS is an integer ``.npy`` of shape [B, S]; LOGITS is written as float32
[B, S, V]. The parameters come from ``load_parameters_path`` (a dropless
checkpoint step) or ``hf_model_path`` (a Hugging Face directory; its
config.json gives the model keys); one of them is required. The model runs
as the trainer builds it (same mesh, shardings and expert parallelism), in
``dtype``, with positions 0..S-1 and no MTP logits. Useful for evaluation
and for checking parity with other implementations.

Bad input (a config problem, missing or malformed files) is one line on
stderr and exit code 2.
"""

import argparse
import os
import sys

import numpy as np

from dropless.config.loader import ConfigError


def parse_args(args: list[str]):
    """(namespace with tokens, out; the remaining config args)."""
    from dropless.cli import CONFIG_ARGS_HELP

    parser = argparse.ArgumentParser(
        prog="dropless forward", description=__doc__.splitlines()[0],
        usage="dropless forward [config.yml] [key=value ...] --tokens TOKENS --out OUT",
        epilog="The parameters come from load_parameters_path (a dropless checkpoint step) or "
               f"hf_model_path (a Hugging Face directory); one is required. {CONFIG_ARGS_HELP}")
    parser.add_argument("--tokens", required=True, help="int .npy [B, S]")
    parser.add_argument("--out", required=True, help="where to write float32 logits [B, S, V] (.npy)")
    ns, rest = parser.parse_known_args(args)
    unknown = [a for a in rest if a.startswith("--")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return ns, rest


def read_tokens(path: str, vocab_size: int) -> np.ndarray:
    """The [B, S] int32 tokens of ``path``.

    Raises:
      ConfigError: no such file, not a .npy, not 2-D integers, ids outside [0, vocab_size).
    """
    try:
        tokens = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ConfigError(f"--tokens {path}: no such file") from None
    except (ValueError, OSError) as e:
        raise ConfigError(f"--tokens {path} is not a .npy array: {e}") from None
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"--tokens {path} must be integers of shape [B, S], got {tokens.dtype} {list(tokens.shape)}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ConfigError(f"--tokens {path} holds ids in [{tokens.min()}, {tokens.max()}], "
                          f"outside the vocabulary [0, {vocab_size})")
    return tokens.astype(np.int32)


def forward_logits(model_cfg, train_cfg, mesh_cfg, tokens_BS: np.ndarray) -> np.ndarray:
    """float32 logits [B, S, V] of the model whose parameters ``train_cfg`` names.

    Raises:
      ConfigError: neither load_parameters_path nor hf_model_path, or a batch
        that does not split over the mesh's batch shards.
      train.checkpoint.CheckpointError, hf.load.HFCheckpointError: as loading.
    """
    import jax
    from flax import nnx

    from dropless.parallel import ep as ep_lib
    from dropless.parallel import mesh as mesh_lib
    from dropless.train import checkpoint as ckpt_lib
    from dropless.train import step as step_lib

    if not (train_cfg.load_parameters_path or train_cfg.hf_model_path):
        raise ConfigError("forward needs load_parameters_path or hf_model_path")
    mesh = mesh_lib.make_mesh(mesh_cfg)
    shards = mesh_lib.batch_shards(mesh)
    if tokens_BS.shape[0] % shards:
        raise ConfigError(f"--tokens batch {tokens_BS.shape[0]} does not split over the mesh's {shards} batch shards")
    ep = ep_lib.from_config(mesh, mesh_cfg)
    abstract_model = nnx.eval_shape(lambda: step_lib.build_model(model_cfg, 0, None, ep))
    graphdef, params, bias, _ = step_lib.split_model(abstract_model)
    abstract = {"params": params, "router_bias": bias}
    shardings = mesh_lib.param_shardings(mesh, abstract)
    loaded = ckpt_lib.initial_parameters(model_cfg, train_cfg, abstract, shardings)

    @jax.jit
    def run(params, bias, tokens):
        return nnx.merge(graphdef, params, bias, {})(tokens).logits_BSV

    tokens = jax.device_put(tokens_BS, mesh_lib.batch_sharding(mesh))
    return np.asarray(jax.device_get(run(loaded["params"], loaded["router_bias"], tokens)), np.float32)


def main(args: list[str]) -> int:
    """Entry point of ``dropless forward``; returns the exit code.

    Raises:
      ConfigError: bad input (the CLI prints it, exit code 2).
    """
    ns, rest = parse_args(args)
    from dropless.cli import resolve_args, start_runtime

    cfg = resolve_args(rest).config
    tokens = read_tokens(ns.tokens, cfg.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(ns.out))
    if not os.path.isdir(out_dir):
        raise ConfigError(f"--out {ns.out}: directory {out_dir} does not exist")
    start_runtime(cfg)
    from dropless.train.checkpoint import CheckpointError

    try:
        logits = forward_logits(cfg.model(), cfg.train(), cfg.mesh(), tokens)
    except CheckpointError as e:
        print(f"dropless: {e}", file=sys.stderr)
        return 2
    np.save(ns.out, logits)
    print(f"wrote {ns.out}: float32 {list(logits.shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
