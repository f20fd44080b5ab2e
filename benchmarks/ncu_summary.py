"""A ``kernel_anatomy`` results record from Nsight Compute raw pages (``ncu --page raw``).

``fp8_kernel_anatomy.sh`` runs it on the GPU machine after its ``ncu`` passes, so
the figures quoted from those passes (tensor-pipe activity, issue-slot use,
instructions, stall reasons, registers) sit in a record with the GPU, the jax
version and the commit, like every other benchmark's. Given raw pages already
copied off the machine (``.txt`` or ``.txt.gz``), it writes the same record here;
then ``--commit`` names the commit the pages were measured at, and the GPU is read
from the pages themselves (``device__attribute_display_name``).

  python3 benchmarks/ncu_summary.py --out DIR [--commit SHA] NAME=RAW_PAGE ...
"""

import argparse
import gzip
import pathlib
import re

from dropless.perf import measure

# metric name in the raw page -> the record's key
METRICS = {
    "gpu__time_duration.sum": "duration_ms_at_ncu_clocks",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pipe_active_pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "smsp__inst_executed.sum": "warp_instructions",
    "launch__registers_per_thread": "registers_per_thread",
    "smsp__sass_inst_executed_op_global_ld.sum": "global_loads",
    "smsp__sass_inst_executed_op_local_ld.sum": "local_loads",
    "smsp__sass_inst_executed_op_shared_ld.sum": "shared_loads",
    # the memory side (the bf16 wgrad under skew, notes/gmm.md)
    "dram__bytes_read.sum": "dram_read_gb",
    "lts__t_sector_hit_rate.pct": "l2_hit_rate_pct",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_throughput_pct",
    "sm__cycles_active.min": "sm_active_cycles_min",
    "sm__cycles_active.max": "sm_active_cycles_max",
}
STALL = re.compile(r"smsp__average_warps_issue_stalled_([a-z_]+)_per_issue_active\.ratio$")
LINE = re.compile(r"^\s+(\S+)\s+(?:\S+\s+)?(-?[\d,]*\.?\d+)\s*$")


def read_page(path):
    path = pathlib.Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return f.read()


def summarize(text):
    """The METRICS and every stall reason's ratio per issued instruction, from one
    kernel's raw page; the GPU's name under ``gpu``."""
    out, stalls = {}, {}
    for line in text.splitlines():
        if "device__attribute_display_name" in line:
            out["gpu"] = line.split("device__attribute_display_name", 1)[1].strip()
            continue
        m = LINE.match(line)
        if not m:
            continue
        name, value = m.group(1), float(m.group(2).replace(",", ""))
        if name in METRICS:
            out[METRICS[name]] = value
        elif s := STALL.match(name):
            if value:
                stalls[s.group(1)] = value
    out["stalls_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pages", nargs="+", metavar="NAME=RAW_PAGE")
    p.add_argument("--out", default=str(measure.DEFAULT_RESULTS_DIR))
    p.add_argument("--commit", help="the commit the pages were measured at (default: this one)")
    p.add_argument("--config", default="", help="what was profiled, in words")
    a = p.parse_args(argv)
    record = measure.new_record("kernel_anatomy", {"what": a.config, "source": "ncu --page raw"})
    if a.commit:
        record["commit"] = {"commit": a.commit, "dirty": None, "source": "--commit"}
        record["versions"]["note"] = ("of the machine that summarized the pages; the GPU "
                                      "machine runs the same pinned jax")
    for spec in a.pages:
        name, _, path = spec.partition("=")
        if not path:
            p.error(f"{spec!r}: expected NAME=RAW_PAGE")
        row = {"kernel": name, **summarize(read_page(path))}
        record["rows"].append(row)
        print(name, {k: v for k, v in row.items() if k != "stalls_per_issue"})
    gpus = {r.get("gpu") for r in record["rows"]} - {None}
    if gpus:  # the profiled GPU, not the machine this runs on
        gpu = ", ".join(sorted(gpus))
        record["device"] = {"platform": "gpu", "gpu": gpu, "count": 1,
                            "slug": measure.slug(gpu), "from": "the ncu pages"}
    print(f"record: {measure.write_record(record, a.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
