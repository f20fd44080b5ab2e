"""``dropless tokenize``: text files -> one ``.npy`` token file, once, for multi-host training.

``dataset_type=text`` over ``.txt`` / ``.jsonl`` / ``.parquet`` files makes
every process tokenize the whole corpus at start. Tokenizing once here and
pointing ``dataset_path`` at the result removes that: the ``.npy`` file is
memory-mapped and each process reads only the windows of its own rows. The
file holds exactly the token stream ``TextSource`` builds from the same files
(``data.token_pieces``: each document, then the end-of-text token), so
training on either gives the same batches.

    python -m dropless tokenize corpus/ --out tokens.npy [--tokenizer tokenizer.json]

Writing streams through a raw temporary file (memory stays bounded by one
document), then into ``<out>.partial.npy``, which replaces ``--out`` only when
complete; an existing ``--out`` is never replaced without ``--force``. A
sidecar ``<out>.json`` records the source files, tokenizer, token and
document counts. Ids are stored as uint16 when the tokenizer's vocabulary
fits, else int32.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

EXIT_BAD_INPUT = 2
_COPY_CHUNK = 1 << 24  # tokens per copy from the raw file into the .npy


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def tokenize_to_npy(dataset_path: str, out: str, *, tokenizer_path: str = "",
                    vocab_size: int | None = None, force: bool = False,
                    progress=None) -> dict:
    """Tokenize every file of ``dataset_path`` into the ``.npy`` file ``out``.

    Args:
      dataset_path: a file, directory or glob, as the ``dataset_path`` key
        (``.txt`` / ``.jsonl`` / ``.parquet``; a ``.npy`` is already tokens).
      out: the ``.npy`` path to write.
      tokenizer_path: a ``tokenizer.json``; empty for UTF-8 bytes.
      vocab_size: if given, the model's vocabulary: a larger tokenizer is an error.
      force: replace an existing ``out``.
      progress: a ``rich.progress.Progress`` to report on, or None.

    Returns:
      The sidecar record (also written to ``<out>.json``).

    Raises:
      FileNotFoundError / ValueError: bad paths, files or tokenizer, with the
        offending name; ``out`` exists and not ``force``. Nothing is left
        behind and an existing ``out`` is untouched.
    """
    from dropless.train import data

    if not out.endswith(".npy"):
        raise ValueError(f"--out {out!r} must end in .npy")
    if os.path.exists(out) and not force:
        raise ValueError(f"--out {out!r} exists; pass --force to replace it")
    files = data.list_text_files(dataset_path)
    already = [f for f in files if f.endswith(".npy")]
    if already:
        raise ValueError(f"dataset_path: {already[0]!r} is a .npy token file already; "
                         "tokenize takes .txt / .jsonl / .parquet files")
    tok = data.make_tokenizer(tokenizer_path)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tok.name} has {tok.vocab_size} tokens but "
                         f"vocab_size={vocab_size}")
    dtype = _dtype_for(tok.vocab_size)
    partial, raw = out[:-len(".npy")] + ".partial.npy", out + ".raw"
    task = progress.add_task("tokenize", total=len(files)) if progress is not None else None
    tokens = documents = 0
    t0 = time.perf_counter()
    try:
        with open(raw, "wb") as f:
            for file in files:
                for piece in data.token_pieces(file, tok):
                    f.write(piece.astype(dtype).tobytes())
                    tokens += len(piece)
                    documents += 1
                if progress is not None:
                    progress.update(task, advance=1, description=f"{tokens:,} tokens")
        array = np.lib.format.open_memmap(partial, mode="w+", dtype=dtype, shape=(tokens,))
        source = np.memmap(raw, dtype=dtype, mode="r", shape=(tokens,)) if tokens else None
        for start in range(0, tokens, _COPY_CHUNK):
            array[start:start + _COPY_CHUNK] = source[start:start + _COPY_CHUNK]
        array.flush()
        del array, source
        record = {
            "dataset_path": dataset_path, "files": files, "tokenizer": tok.name,
            "tokenizer_path": tokenizer_path, "tokenizer_vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id, "dtype": dtype.name, "tokens": tokens,
            "documents": documents,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        with open(partial + ".json", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(partial, out)
        os.replace(partial + ".json", out + ".json")
    finally:
        for leftover in (raw, partial, partial + ".json"):
            if os.path.exists(leftover):
                os.remove(leftover)
    return record


def main(argv: list[str]) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    p = argparse.ArgumentParser(
        prog="dropless tokenize",
        description="Tokenize text files once into one .npy token file (dataset_path for training).")
    p.add_argument("dataset_path", help="a .txt/.jsonl/.parquet file, a directory or a glob")
    p.add_argument("--out", required=True, help="the .npy token file to write")
    p.add_argument("--tokenizer", default="", help="a tokenizer.json (default: UTF-8 bytes)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the model's vocab_size: a larger tokenizer is an error")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    console = Console(stderr=True)
    try:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total} files"), TimeElapsedColumn(),
                      console=console, transient=not console.is_terminal) as progress:
            record = tokenize_to_npy(args.dataset_path, args.out, tokenizer_path=args.tokenizer,
                                     vocab_size=args.vocab_size, force=args.force,
                                     progress=progress)
    except (FileNotFoundError, ValueError) as e:
        print(f"dropless tokenize: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {args.out}: {record['tokens']:,} tokens ({record['dtype']}) from "
          f"{len(record['files'])} file(s), tokenizer {record['tokenizer']}, "
          f"{record['seconds']:.1f} s; train with dataset_type=text dataset_path={args.out}")
    return 0
