"""Where a kernel's warps wait, per SASS instruction, from an Nsight Compute source page.

Reads the CSV that ``ncu -i REPORT --page source --print-source sass --csv`` writes
(``benchmarks/fp8_kernel_anatomy.sh`` keeps it gzipped as ``ncu-source-VARIANT.csv.gz``)
and prints:

- the stall reasons summed over the kernel, as shares of all samples;
- the same by opcode (``FFMA``, ``QGMMA``, ``SYNCS``, ...), with executed counts;
- the hottest instructions, each with its address, text and top stall reasons.

    python benchmarks/ncu_source_hot.py results/logs/.../ncu-source-rows_gtw8.csv.gz [--top 25]

Several pages side by side: pass several files; each gets its own sections.
"""

import argparse
import collections
import csv
import gzip
import pathlib
import sys

STALL_PREFIX = "stall_"


def read_page(path):
    """(kernel name, rows as dicts) of one source page CSV (plain or gzipped)."""
    path = pathlib.Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        lines = f.read().splitlines()
    kernel = ""
    start = 0
    for i, line in enumerate(lines):
        if line.startswith('"Kernel Name"'):
            kernel = next(csv.reader([line]))[1]
        if line.startswith('"Address"'):
            start = i
            break
    else:
        raise ValueError(f"{path}: no header row starting with \"Address\" "
                         "(not an ncu source page)")
    rows = list(csv.DictReader(lines[start:]))
    return kernel, rows


def _int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def stall_columns(rows):
    """The all-samples stall columns (not the "(Not Issued)" copies)."""
    return [c for c in rows[0] if c.startswith(STALL_PREFIX) and "(Not Issued)" not in c]


def opcode(source):
    """``FFMA`` from ``"      @P0 FFMA R1, R2, R3, R4"`` (predicate and modifiers dropped)."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def summarize(rows):
    """Totals: samples per stall reason, and per opcode (samples, executed, stall mix)."""
    stalls = stall_columns(rows)
    total = collections.Counter()
    by_op = collections.defaultdict(collections.Counter)
    executed = collections.Counter()
    for row in rows:
        op = opcode(row["Source"])
        executed[op] += _int(row["Instructions Executed"])
        for s in stalls:
            n = _int(row[s])
            total[s] += n
            by_op[op][s] += n
    return total, by_op, executed


def _top(counter, n, denom):
    return ", ".join(f"{k.removeprefix(STALL_PREFIX)} {100 * v / denom:.1f}%"
                     for k, v in counter.most_common(n) if v)


def report(path, top=25, out=sys.stdout):
    kernel, rows = read_page(path)
    total, by_op, executed = summarize(rows)
    samples = sum(total.values()) or 1
    print(f"== {path} ({kernel}): {samples} samples, {len(rows)} instructions", file=out)
    print("stall reasons (share of all samples): " + _top(total, 12, samples), file=out)
    print(f"{'opcode':<12}{'samples %':>10}{'executed':>14}  top stalls", file=out)
    ops = sorted(by_op, key=lambda o: -sum(by_op[o].values()))
    for op in ops[:top]:
        n = sum(by_op[op].values())
        if not n:
            continue
        print(f"{op:<12}{100 * n / samples:>10.1f}{executed[op]:>14}  {_top(by_op[op], 3, n)}",
              file=out)
    print("hottest instructions:", file=out)
    stalls = stall_columns(rows)
    ranked = sorted(rows, key=lambda r: -sum(_int(r[s]) for s in stalls))
    for row in ranked[:top]:
        mix = collections.Counter({s: _int(row[s]) for s in stalls})
        n = sum(mix.values())
        if not n:
            break
        print(f"  {row['Address'][-5:]} {100 * n / samples:5.1f}%  {row['Source'].strip()[:60]:<60}"
              f"  {_top(mix, 3, n)}", file=out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pages", nargs="+", help="ncu source page CSVs (.csv or .csv.gz)")
    p.add_argument("--top", type=int, default=25, help="opcodes and instructions to list")
    args = p.parse_args(argv)
    for page in args.pages:
        try:
            report(page, args.top)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
