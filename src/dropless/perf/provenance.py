"""Which code a results record measured: a digest of the source tree, checkable later.

A record names its commit, but on a remote GPU machine the commit comes from the
caller (``DROPLESS_COMMIT``: the machine's copy of ``.git`` may be stale), and a
caller can get it wrong. So records also carry ``source_digest``: a SHA-256 over
the files that decide what a benchmark runs (``DIGEST_GLOBS``: the package's
Python and JSON files, the benchmark scripts), computed from the tree that ran.
``source_digest_at`` computes the same digest from a commit's files in git, and::

    python -m dropless.perf.provenance benchmarks/results/*.json

says for each record whether the code that ran is the code of the commit it names.
Exit code 1 when any record's digest differs from its commit's, 2 on bad input.
``--digest`` prints this tree's digest (``tools/gpu_run.sh`` writes it into every
device call's ``gpu.txt``, so logs without a record can be checked too), and
``--digest COMMIT`` a commit's.
"""

import argparse
import fnmatch
import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
# Relative to the repository root; fnmatch patterns ("*" crosses "/", so "src/dropless/*.py"
# takes every package file at any depth, and benchmarks/*.py must not go deeper).
DIGEST_GLOBS = ("src/dropless/*.py", "src/dropless/*.json", "benchmarks/*.py", "benchmarks/*.sh")


def _selected(path: str) -> bool:
    if path.startswith("benchmarks/") and path.count("/") > 1:
        return False  # the scripts only, not results/ or notes/
    return any(fnmatch.fnmatch(path, g) for g in DIGEST_GLOBS)


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
    files = []
    for top in ("src/dropless", "benchmarks"):
        for p in (root / top).rglob("*"):
            rel = p.relative_to(root).as_posix()
            if p.is_file() and "__pycache__" not in rel and _selected(rel):
                files.append((rel, p.read_bytes()))
    return _digest(files)


def source_digest_at(commit: str, repo: Path = REPO_ROOT) -> str:
    """The digest of ``commit``'s files, read from git.

    Raises:
      ValueError: the commit is not in ``repo``'s history.
    """
    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, check=True,
                              timeout=60).stdout
    try:
        names = git("ls-tree", "-r", "--name-only", commit, "--", "src/dropless", "benchmarks")
    except subprocess.CalledProcessError as e:
        raise ValueError(f"commit {commit!r} is not in this repository's history") from e
    paths = [n for n in names.decode().splitlines() if _selected(n)]
    return _digest((p, git("show", f"{commit}:{p}")) for p in paths)


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
