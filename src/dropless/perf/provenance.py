"""Which code a results record measured: a digest of the source tree, checkable later.

A record names its commit, but on a remote GPU machine the commit comes from the
caller (``DROPLESS_COMMIT``: the machine's copy of ``.git`` may be stale), and a
caller can get it wrong. So records also carry ``source_digest``: a SHA-256 over
the files that decide what a benchmark runs (``digested``: the package's Python
and JSON files, the benchmark scripts), computed from the tree that ran.
``source_digest_at`` computes the same digest from a commit's files in git, and::

    python -m dropless.perf.provenance benchmarks/results/*.json

says for each record whether the code that ran is the code of the commit it names.
Exit code 1 when any record's digest differs from its commit's, 2 on bad input.
``--digest`` prints this tree's digest (``tools/gpu_run.sh`` writes it into every
device call's ``gpu.txt``, so logs without a record can be checked too), and
``--digest COMMIT`` a commit's.
"""

import argparse
import functools
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path, PurePosixPath

REPO_ROOT = Path(__file__).resolve().parents[3]


def digested(path: str) -> bool:
    """Whether a file (its path relative to the repository root) is in the digest: the
    package's .py and .json files at any depth, and the scripts directly in benchmarks/
    (not results/ or notes/)."""
    p = PurePosixPath(path)
    if p.parts[:2] == ("src", "dropless"):
        return p.suffix in (".py", ".json") and "__pycache__" not in p.parts
    return p.parent == PurePosixPath("benchmarks") and p.suffix in (".py", ".sh")


def _digest(files) -> str:
    """SHA-256 of (path, content) pairs in path order, as ``sha256:<hex>``."""
    h = hashlib.sha256()
    for path, content in sorted(files):
        h.update(path.encode() + b"\0" + content + b"\0")
    return "sha256:" + h.hexdigest()


def source_digest(root: Path = REPO_ROOT) -> str | None:
    """The digest of the working tree at ``root`` (None if it has no ``src/dropless``)."""
    root = Path(root)
    if not (root / "src" / "dropless").is_dir():
        return None
    candidates = [*(root / "src" / "dropless").rglob("*"), *(root / "benchmarks").glob("*")]
    return _digest((p.relative_to(root).as_posix(), p.read_bytes()) for p in candidates
                   if p.is_file() and digested(p.relative_to(root).as_posix()))


@functools.lru_cache(maxsize=None)
def source_digest_at(commit: str, repo: Path = REPO_ROOT) -> str:
    """The digest of ``commit``'s files, read from git in one ``git archive``; cached
    per commit, since many records name the same one.

    Raises:
      ValueError: the commit is not in ``repo``'s history.
    """
    try:
        tar = subprocess.run(["git", "archive", "--format=tar", commit, "--", "src/dropless",
                              "benchmarks"], cwd=repo, capture_output=True, check=True,
                             timeout=120).stdout
    except subprocess.CalledProcessError as e:
        raise ValueError(f"commit {commit!r} is not in this repository's history") from e
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        return _digest((m.name, archive.extractfile(m).read()) for m in archive.getmembers()
                       if m.isfile() and digested(m.name))


def record_claim(record: dict) -> tuple[str | None, str | None]:
    """(commit, source digest) a record states; either may be None."""
    commit = record.get("commit")
    if isinstance(commit, dict):
        commit = commit.get("commit")
    if isinstance(commit, str):
        commit = commit.removesuffix("-dirty") or None
    return commit, record.get("source_digest")


def check(path: Path, repo: Path = REPO_ROOT) -> tuple[str, str]:
    """(verdict, detail) for one record file: "matches", "differs", "no digest" or
    "unknown commit"."""
    commit, digest = record_claim(json.loads(Path(path).read_text()))
    if not digest:
        return "no digest", "the record predates source digests"
    if not commit or commit == "unknown":
        return "unknown commit", "the record names no commit"
    try:
        want = source_digest_at(commit, repo)
    except ValueError as e:
        return "unknown commit", str(e)
    if want == digest:
        return "matches", f"the code that ran is {commit[:12]}'s"
    return "differs", f"the code that ran is not {commit[:12]}'s (its digest differs)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", nargs="*", help="results record JSON files")
    p.add_argument("--repo", type=Path, default=REPO_ROOT,
                   help="the git repository whose history holds the commits")
    p.add_argument("--digest", nargs="?", const="", metavar="COMMIT",
                   help="print the digest of this tree, or of COMMIT's files, and exit")
    args = p.parse_args(argv)
    if args.digest is not None:
        try:
            print(source_digest_at(args.digest, args.repo) if args.digest
                  else source_digest(args.repo))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if not args.records:
        p.error("give record files to check, or --digest")
    worst = 0
    for name in args.records:
        try:
            verdict, detail = check(Path(name), args.repo)
        except (OSError, json.JSONDecodeError) as e:
            print(f"error: {name}: {e}", file=sys.stderr)
            return 2
        print(f"{verdict:<15} {name}: {detail}")
        worst = max(worst, verdict == "differs")
    return worst


if __name__ == "__main__":
    sys.exit(main())
