"""Peak host memory of loading a Hugging Face DeepSeek-V3 directory (``hf_model_path``).

    JAX_PLATFORMS=cpu PYTHONPATH=src python3 benchmarks/hf_load_memory.py [--dir DIR] [--out DIR]
    PYTHONPATH=src python3 benchmarks/hf_load_memory.py      # on a GPU: parameters in device memory

Writes (once; reused when ``DIR/config.json`` exists) a random DeepSeek-V3
directory in the published layout, bf16, sharded at 256 MiB: by default
D=1024, 6 layers (1 dense), 64 experts of width 512, vocabulary 32000,
about 0.6 B parameters = 1.2 GB. Then, in a fresh process, loads it with
``hf.load.load_hf`` into bf16 parameters on one device while a thread
samples ``/proc/self/status`` every 5 ms (on the first device: CPU, or a GPU
where there is one), and records:

* ``rss_before`` (JAX started, model built abstractly), ``peak_rss``
  (VmHWM) and the sampled peaks of anonymous and file-backed resident memory;
* ``params_bytes``: what the loaded parameters occupy. On CPU the device
  *is* host memory, so the loaded parameters are part of the resident set;
  ``overhead = peak_rss - rss_before - params_bytes`` is what loading needed
  beyond them. On a GPU the parameters live in device memory and
  ``overhead = peak_rss - rss_before``;
* ``largest_tensor_bytes`` (in the files) and ``largest_cell_f32_bytes``:
  the biggest region read at once, as float32 (the loader reads a cell as
  float32, then casts it), to compare with the overhead.

Appends nothing; writes ``<out>/hf_load_memory-<time>-<device>.json``.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
    num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1,
    n_routed_experts=64, routed_scaling_factor=2.5, kv_lora_rank=256, q_lora_rank=384,
    qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, n_group=8, topk_group=4,
    num_experts_per_tok=6, first_k_dense_replace=1, norm_topk_prob=True, hidden_act="silu",
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_theta=10000.0, rope_scaling=None, model_type="deepseek_v3", num_nextn_predict_layers=0,
    architectures=["DeepseekV3ForCausalLM"],
)


def write_model(path: str) -> None:
    """A random published-layout directory of ``CONFIG`` (written one tensor at a time)."""
    import ml_dtypes

    from dropless.config.loader import load_config
    from dropless.hf import deepseek_v3
    from dropless.hf.safetensors_io import write_sharded

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    cfg = load_config(None, [f"hf_model_path={path}"]).config.model()
    rng = np.random.default_rng(0)

    def tensors():
        for leaf in deepseek_v3.mapping(cfg, "published").leaves:
            for cell in leaf.grid.flat:
                for part in cell:
                    dtype = np.float32 if leaf.float32 else ml_dtypes.bfloat16
                    yield part.name, (0.02 * rng.standard_normal(part.hf_shape, np.float32)).astype(dtype)

    write_sharded(tensors(), path, max_shard_bytes=256 * 2**20)


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def measure(path: str) -> dict:
    """Load ``path`` (bf16 params, one CPU device) and return the memory figures."""
    import jax
    from flax import nnx

    from dropless.config.loader import load_config
    from dropless.hf import deepseek_v3
    from dropless.hf.load import load_hf
    from dropless.hf.safetensors_io import TensorDir
    from dropless.train import step as step_lib

    cfg = load_config(None, [f"hf_model_path={path}", "weight_dtype=bfloat16", "dtype=bfloat16"]).config
    model = cfg.model()
    abstract_model = nnx.eval_shape(lambda: step_lib.build_model(model, 0))
    _, params, bias, _ = step_lib.split_model(abstract_model)
    abstract = {"params": params, "router_bias": bias}
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, abstract)
    jax.block_until_ready(jax.numpy.zeros(1))
    tdir = TensorDir(path)
    before = _status()
    peaks = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            s = _status()
            for k in peaks:
                peaks[k] = max(peaks[k], s[k])
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    loaded = load_hf(path, model, abstract, shardings)
    jax.block_until_ready(loaded)
    seconds = time.perf_counter() - t0
    done.set()
    thread.join()
    after = _status()
    leaves = jax.tree.leaves(loaded)
    params_bytes = sum(x.nbytes for x in leaves)
    file_bytes = sum(tdir.nbytes(n) for n in tdir.names)
    largest = max(tdir.names, key=tdir.nbytes)
    cell = max(4 * int(np.prod(leaf.shape[leaf.grid.ndim:]))
               for leaf in deepseek_v3.mapping(model, "published").leaves)
    return {
        "params": sum(x.size for x in leaves), "params_bytes": params_bytes, "file_bytes": file_bytes,
        "largest_tensor": largest, "largest_tensor_bytes": tdir.nbytes(largest),
        "largest_cell_f32_bytes": cell, "load_seconds": seconds,
        "rss_before": before["VmRSS"], "peak_rss": after["VmHWM"], "rss_after": after["VmRSS"],
        "peak_rss_anon_sampled": peaks["RssAnon"], "peak_rss_file_sampled": peaks["RssFile"],
        "platform": jax.devices()[0].platform,
        # On CPU the parameters are host memory too; on a GPU they are not.
        "overhead": after["VmHWM"] - before["VmRSS"] - (params_bytes if jax.devices()[0].platform == "cpu" else 0),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/dropless-hf-load-memory", help="model directory (made if absent)")
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:  # the measurement, in a process that has done nothing else
        print(json.dumps(measure(ns.dir)))
        return 0
    if not os.path.exists(os.path.join(ns.dir, "model.safetensors.index.json")):
        t0 = time.perf_counter()
        write_model(ns.dir)
        print(f"wrote {ns.dir} in {time.perf_counter() - t0:.1f} s")
    proc = subprocess.run([sys.executable, __file__, "--dir", ns.dir, "--child"], check=True,
                          capture_output=True, text=True)
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    from dropless.perf import measure as measure_lib

    record = measure_lib.new_record("hf_load_memory", {"hf_config": CONFIG, "weight_dtype": "bfloat16"})
    record["rows"].append(row)
    path = measure_lib.write_record(record, ns.out or measure_lib.DEFAULT_RESULTS_DIR)
    gb = 1e9
    print(f"model {row['params'] / 1e9:.3f} B params, files {row['file_bytes'] / gb:.3f} GB, "
          f"loaded params {row['params_bytes'] / gb:.3f} GB in {row['load_seconds']:.1f} s")
    print(f"host RSS before {row['rss_before'] / gb:.3f} GB, peak {row['peak_rss'] / gb:.3f} GB: "
          f"overhead beyond the parameters {row['overhead'] / gb:.3f} GB "
          f"(largest tensor {row['largest_tensor_bytes'] / gb:.3f} GB, largest cell as float32 "
          f"{row['largest_cell_f32_bytes'] / gb:.3f} GB); peak file-backed RSS "
          f"{row['peak_rss_file_sampled'] / gb:.3f} GB")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
