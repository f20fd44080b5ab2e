"""XLA:GPU's optimized HLO for an NVIDIA H200, compiled on a host without a GPU.

Which GEMMs cuBLASLt runs and in which dtypes, and which fusions sit between
them, shows only in the optimized HLO, which otherwise needs the GPU. With jax's
CUDA plugin installed (``make gpu-compile-venv``: the ``gpu-compile`` extra, the
plugin without NVIDIA's libraries) PJRT compiles for the device a
``GpuTargetConfigProto`` describes (``gpu_specs/h200.txtpb``): the plugin loads
without cuDNN under ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``, and
``jax.experimental.topologies`` gives a compile-only device for the arguments'
sharding. Nothing runs and nothing is autotuned (each cuBLAS call keeps algorithm
0), so the HLO is what the H200 compiles but for the GEMM algorithms.

Code that picks a path by the device sees the CPU on such a host; ``gpu_view``
makes the process see the compile-only GPU instead, so the GPU's branches are the
ones traced:
- ``jax.devices()`` returns the topology's device (platform "gpu", its device kind,
  compute capability and SM count): meshes are built on it, and the probes that
  read it (``ops.gmm.mosaic.is_available``, the SM count of the persistent grids,
  the tuning table's GPU name) answer as on the H200;
- ``jax.default_backend()`` answers "gpu" (``ops.fp8_dot``'s dot algorithm);
- jax's cuDNN attention checks (``jax._src.cudnn.fused_attention_stablehlo``): the
  cuDNN version is taken as ``CUDNN_VERSION`` (9.12, the least jax's CUDA 13 plugin
  0.11.2 accepts; no cuDNN library is loaded) and the compute capability as the
  device's. cuDNN's fused attention then lowers to its ``__cudnn$fmha`` calls.

    .venv-gpucompile/bin/python -m dropless.perf.gpu_compile PROG.py [--grep TEXT] [--dump DIR]

``PROG.py`` defines ``FN`` and ``ARGS`` (a tuple of ``jax.ShapeDtypeStruct``).
``tools/compile_step_for_gpu.py`` compiles the trainer's own step this way.
"""

import argparse
import contextlib
import os
import runpy
import sys
from pathlib import Path

SPECS = Path(__file__).parent / "gpu_specs"
DEFAULT_SPEC = SPECS / "h200.txtpb"
CUDNN_VERSION = 91200


class NoCudaPlugin(RuntimeError):
    """jax's CUDA plugin is not installed in this Python."""


def plugin_installed() -> bool:
    """Whether jax's CUDA 13 plugin can be imported (the ``gpu-compile`` extra)."""
    import importlib.util

    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def devices(spec: Path = DEFAULT_SPEC, count: int = 1) -> list:
    """The compile-only devices of one host holding ``count`` GPUs of the kind ``spec``
    describes (XLA's topology ``1x1x<count>``).

    Raises:
      NoCudaPlugin: the plugin is not installed.
    """
    if not plugin_installed():
        raise NoCudaPlugin("jax's CUDA plugin is not installed here: run `make gpu-compile-venv` "
                           "and use .venv-gpucompile/bin/python (the gpu-compile extra)")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no cuDNN on the host
    from jax.experimental import topologies

    topology = topologies.get_topology_desc("", "cuda", target_config=Path(spec).read_text(),
                                            topology=f"1x1x{count}")
    return list(topology.devices)


@contextlib.contextmanager
def gpu_view(gpu_devices):
    """``jax.devices``, ``jax.default_backend`` and jax's cuDNN attention checks answering as
    on ``gpu_devices`` (module docstring); restored on exit."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    capability = tuple(int(x) for x in gpu_devices[0].compute_capability.split("."))

    def version(text):
        return tuple(int(x) for x in text.split("."))

    patches = [(jax, "devices", lambda backend=None: list(gpu_devices)),
               (jax, "default_backend", lambda: "gpu"),
               (cudnn_attention, "check_cudnn_version", lambda: CUDNN_VERSION),
               (cudnn_attention, "check_compute_capability", lambda c: capability >= version(c)),
               (cudnn_attention, "is_cuda_compute_capability_equal",
                lambda c: capability == version(c))]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def compile_text(fn, *args, spec: Path = DEFAULT_SPEC, as_gpu: bool = True) -> str:
    """The optimized HLO text of ``jax.jit(fn)(*args)`` compiled for the GPU ``spec`` describes.

    Args:
      fn: the function (jitted here).
      args: arrays or ``jax.ShapeDtypeStruct``s (only shapes and dtypes are used).
      spec: a ``GpuTargetConfigProto`` text file.
      as_gpu: trace under ``gpu_view`` (module docstring).

    Raises:
      NoCudaPlugin: the plugin is not installed.
    """
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    gpus = devices(spec)
    sharding = NamedSharding(Mesh(gpus[:1], ("x",)), PartitionSpec())
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    with gpu_view(gpus) if as_gpu else contextlib.nullcontext():
        lowered = jax.jit(fn).lower(*structs)
    return lowered.compile().as_text()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prog", type=Path, help="a Python file defining FN and ARGS")
    p.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="GpuTargetConfigProto text file")
    p.add_argument("--grep", default=None, help="print only the lines holding this text")
    p.add_argument("--dump", type=Path, default=None, help="XLA's HLO after every pass, to this folder")
    p.add_argument("--no-as-gpu", action="store_true",
                   help="trace with jax.default_backend() as it is (cpu on a host without a GPU)")
    a = p.parse_args(argv)
    if a.dump:
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={a.dump} "
                                   "--xla_dump_hlo_pass_re=.*").strip()
    for path, what in ((a.prog, "program"), (a.spec, "spec")):
        if not path.is_file():
            print(f"error: {what} {path} is not a file", file=sys.stderr)
            return 2
    names = runpy.run_path(str(a.prog))
    if "FN" not in names or "ARGS" not in names:
        print(f"error: {a.prog} must define FN (a function) and ARGS (a tuple of "
              f"jax.ShapeDtypeStruct)", file=sys.stderr)
        return 2
    try:
        text = compile_text(names["FN"], *names["ARGS"], spec=a.spec, as_gpu=not a.no_as_gpu)
    except NoCudaPlugin as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.grep:
        text = "\n".join(line for line in text.splitlines() if a.grep in line)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
