"""``dropless.perf.provenance``: records carry a digest of the code that ran, and it is
checked against the commit they name."""

import json
import subprocess

import pytest

from dropless.perf import measure, provenance


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A two-commit repository with the digested layout; HEAD~1 and HEAD differ in one
    kernel file; results/ and notes/ files (not digested) change too."""
    r = tmp_path / "repo"
    (r / "src" / "dropless" / "ops").mkdir(parents=True)
    (r / "benchmarks" / "results").mkdir(parents=True)
    (r / "src" / "dropless" / "ops" / "k.py").write_text("X = 1\n")
    (r / "src" / "dropless" / "ops" / "tuning.json").write_text("{}\n")
    (r / "benchmarks" / "gmm.py").write_text("print('gmm')\n")
    (r / "benchmarks" / "results" / "a.json").write_text("{}\n")
    _git(r, "init", "-q")
    _git(r, "-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    _git(r, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    (r / "src" / "dropless" / "ops" / "k.py").write_text("X = 2\n")
    (r / "benchmarks" / "results" / "b.json").write_text("{}\n")
    _git(r, "-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    _git(r, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "two")
    return r


def test_the_tree_digest_equals_its_commits_and_not_the_parents(repo):
    head, parent = _git(repo, "rev-parse", "HEAD"), _git(repo, "rev-parse", "HEAD~1")
    here = provenance.source_digest(repo)
    assert here.startswith("sha256:") and len(here) == 7 + 64
    assert provenance.source_digest_at(head, repo) == here
    assert provenance.source_digest_at(parent, repo) != here
    # Files outside the digest (results, notes, caches) do not change it.
    (repo / "benchmarks" / "results" / "c.json").write_text("{}\n")
    (repo / "src" / "dropless" / "ops" / "__pycache__").mkdir()
    (repo / "src" / "dropless" / "ops" / "__pycache__" / "k.cpython-312.pyc").write_bytes(b"x")
    assert provenance.source_digest(repo) == here
    # An untracked package file does: it would run.
    (repo / "src" / "dropless" / "ops" / "extra.py").write_text("Y = 0\n")
    assert provenance.source_digest(repo) != here
    with pytest.raises(ValueError, match="not in this repository's history"):
        provenance.source_digest_at("f" * 40, repo)


def test_check_says_whether_a_record_ran_the_commit_it_names(repo, tmp_path, capsys):
    head, parent = _git(repo, "rev-parse", "HEAD"), _git(repo, "rev-parse", "HEAD~1")
    digest = provenance.source_digest(repo)
    records = {"right": {"commit": head, "source_digest": digest},          # gmm.py's form
               "wrong": {"commit": {"commit": parent}, "source_digest": digest},  # measure's
               "old": {"commit": head},
               "nowhere": {"commit": "e" * 40, "source_digest": digest}}
    paths = {}
    for name, record in records.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(record))
    verdicts = {name: provenance.check(p, repo)[0] for name, p in paths.items()}
    assert verdicts == {"right": "matches", "wrong": "differs", "old": "no digest",
                        "nowhere": "unknown commit"}
    cli = ["--repo", str(repo)]
    assert provenance.main([*cli, str(paths["right"]), str(paths["old"])]) == 0
    assert provenance.main([*cli, str(paths["right"]), str(paths["wrong"])]) == 1
    out = capsys.readouterr().out
    assert "differs" in out and "is not " + parent[:12] in out
    assert provenance.main([*cli, str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    # --digest: this tree's, or a commit's (what gpu_run.sh writes into gpu.txt).
    assert provenance.main([*cli, "--digest"]) == 0
    assert capsys.readouterr().out.strip() == digest
    assert provenance.main([*cli, "--digest", parent]) == 0
    assert capsys.readouterr().out.strip() == provenance.source_digest_at(parent, repo)
    assert provenance.main([*cli, "--digest", "e" * 40]) == 2


def test_new_records_carry_the_digest_of_this_tree():
    record = measure.new_record("probe", {})
    assert record["source_digest"] == provenance.source_digest()
    assert record["source_digest"].startswith("sha256:")
