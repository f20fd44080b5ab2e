"""Training data: synthetic, Markov (the default) and local text; a pure function of the step.

Legend: A gradient-accumulation microbatches, B global batch per microbatch,
S sequence length (``max_target_length``), V vocabulary, N Markov states (V**order),
M successors per Markov state.

Every source maps ``step -> Batch`` as a pure function of ``(data_seed, step)``,
so a run resumed at step k sees exactly the batches an uninterrupted run sees,
with no iterator state to checkpoint. Each row of a step is made on its own,
from a NumPy generator seeded by ``(data_seed, step, row)`` (text: from its own
window), so a process can make only the rows its devices hold
(``batch_at(step, seqs)``) and they are bit-identical to the same rows of the
whole batch, whatever the number of processes. Row ``r`` of a step is
sequence ``r % B`` of microbatch ``r // B``.

* ``synthetic``: uniform random tokens, for throughput. Nothing to learn: the
  loss floor is ln V.
* ``markov``: a random Markov chain of order ``markov_order`` over V tokens,
  each state followed by one of ``markov_successors`` tokens (all V if fewer)
  with probabilities drawn from Dirichlet(``markov_concentration``), seeded by
  ``data_seed``. Sequences start in the stationary distribution, so every
  next-token target has conditional entropy equal to the chain's entropy rate
  ``H = -sum_s pi_s sum_t P[s,t] ln P[s,t]`` (nats, order 1; for higher
  orders the first order-1 targets of each row are a little less predictable).
  A working trainer's loss falls toward H; it can never go below it.
* ``text``: local ``.txt`` / ``.jsonl`` (field ``text``) / ``.parquet``
  (column ``text``, needs pyarrow) files, a file, a directory or a glob;
  bytes as tokens by default (V >= 256), or a ``tokenizer.json`` through the
  ``tokenizers`` package. Documents are joined with an end-of-text token and
  cut into S+1-token windows, visited in a seeded random order per epoch.
  Every process tokenizes these files once at start. Or one ``.npy`` file of
  token ids (1-D, documents already joined; ``dropless tokenize`` writes it
  from the same files, token for token the stream above), memory-mapped: a
  process then reads from disk only the windows of its own rows.
"""

import glob
import json
import math
import os
from typing import NamedTuple

import numpy as np

from dropless.config.sections import DataConfig

DATASET_TYPES = ("synthetic", "markov", "text")
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".npy")
_MAX_MARKOV_ENTRIES = 1 << 27  # N * M float64 entries (1 GiB)


class Batch(NamedTuple):
    """One optimizer step of data, NumPy arrays [A, B, S].

    inputs: int32 tokens; targets: int32 next tokens; weights: float32 per-token
    loss weights (1 for real tokens).
    """

    inputs: np.ndarray
    targets: np.ndarray
    weights: np.ndarray


def _row_rng(seed: int, step: int, row: int) -> np.random.Generator:
    return np.random.default_rng([seed, step, row, 0x6D61726B])


def _to_batch(tokens: np.ndarray, accum: int, batch: int) -> Batch:
    """tokens [A*B, S+1] -> Batch [A, B, S]."""
    seq = tokens.shape[1] - 1
    tokens = tokens.reshape(accum, batch, seq + 1).astype(np.int32)
    return Batch(tokens[..., :-1], tokens[..., 1:], np.ones((accum, batch, seq), np.float32))


class _RowSource:
    """``batch_at`` for a source that makes any rows of a step by ``rows_at(step, rows)``.

    Subclasses set ``batch`` (B), ``seq`` (S), ``accum`` (A) and define
    ``rows_at(step, rows_R) -> [R, S+1]`` integer tokens.
    """

    batch: int
    seq: int
    accum: int

    def batch_at(self, step: int, seqs: np.ndarray | None = None) -> Batch:
        """Batch [A, len(seqs), S] of step ``step``: sequences ``seqs`` of every microbatch.

        Args:
          seqs: strictly increasing indices into the B sequences of a
            microbatch (default: all); a process passes those its devices hold.

        Raises:
          ValueError: ``seqs`` not a strictly increasing 1-D list of indices in [0, B).
        """
        if seqs is None:
            seqs = np.arange(self.batch)
        seqs = np.asarray(seqs)
        if (seqs.ndim != 1 or not seqs.size or not np.issubdtype(seqs.dtype, np.integer)
                or seqs[0] < 0 or seqs[-1] >= self.batch or np.any(np.diff(seqs) <= 0)):
            raise ValueError(f"seqs={seqs.tolist()} must be strictly increasing sequence indices "
                             f"in [0, {self.batch}) (the batch of one microbatch)")
        rows = (np.arange(self.accum)[:, None] * self.batch + seqs[None, :]).ravel()
        return _to_batch(self.rows_at(step, rows), self.accum, len(seqs))


class SyntheticSource(_RowSource):
    """Uniform random tokens; ``entropy_floor`` = ln V."""

    def __init__(self, vocab_size: int, seed: int, *, batch: int, seq: int, accum: int = 1):
        self.vocab_size, self.seed = vocab_size, seed
        self.batch, self.seq, self.accum = batch, seq, accum
        self.entropy_floor = math.log(vocab_size)
        self.description = f"synthetic uniform tokens over V={vocab_size}"

    def rows_at(self, step: int, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (flat indices into A*B) of step ``step``: [R, S+1] int64."""
        out = np.empty((len(rows), self.seq + 1), np.int64)
        for i, row in enumerate(rows):
            out[i] = _row_rng(self.seed, step, int(row)).integers(0, self.vocab_size, self.seq + 1)
        return out


def stationary_distribution(p_NN: np.ndarray, tol: float = 1e-13, max_iter: int = 100_000):
    """Stationary distribution [N] of a dense row-stochastic matrix, by power iteration.

    Raises:
      RuntimeError: no convergence (a periodic chain).
    """
    n = p_NN.shape[0]
    return _power_iteration(np.broadcast_to(np.arange(n), p_NN.shape), p_NN, n, tol, max_iter)


def _power_iteration(next_NM, p_NM, n, tol=1e-13, max_iter=100_000):
    """Stationary distribution [n] of the sparse chain ``state s -> next_NM[s, j]`` w.p. ``p_NM[s, j]``."""
    pi = np.full(n, 1.0 / n)
    flat = next_NM.ravel()
    for _ in range(max_iter):
        nxt = np.bincount(flat, (pi[:, None] * p_NM).ravel(), n)
        if np.abs(nxt - pi).sum() < tol:
            return nxt / nxt.sum()
        pi = nxt
    raise RuntimeError("Markov chain: power iteration did not converge")


class MarkovSource(_RowSource):
    """A seeded random Markov chain of order ``order`` over ``vocab_size`` tokens.

    Each state (the last ``order`` tokens, encoded s = sum_{j<order} t_{-j} V^j
    with t_0 the latest) may be followed by M = min(``successors``, V)
    distinct tokens, with probabilities drawn from Dirichlet(``concentration``)
    over those M. The table is [N, M], never [N, V], so any vocabulary works
    (V = 129,280 at M = 64: 8.3M entries).

    Attributes:
      successors: [N, M] int32 the possible next tokens of each state, ascending.
      probs: [N, M] float64 their probabilities (rows sum to 1).
      entropy_floor: the entropy rate in nats per token.

    Raises:
      ValueError: order < 1, successors < 1, concentration <= 0, or a table
        of more than 2**27 entries (N x M; 1 GiB of float64).
    """

    def __init__(self, vocab_size, order, concentration, seed, *, batch, seq, accum=1,
                 successors=None):
        if order < 1:
            raise ValueError(f"markov_order={order} must be >= 1")
        if concentration <= 0:
            raise ValueError(f"markov_concentration={concentration} must be > 0")
        m = vocab_size if successors is None else min(successors, vocab_size)
        if m < 1:
            raise ValueError(f"markov_successors={successors} must be >= 1")
        n_states = vocab_size**order
        if n_states * m > _MAX_MARKOV_ENTRIES:
            raise ValueError(
                f"markov_order={order} with vocab_size={vocab_size} and markov_successors={m} needs a "
                f"{n_states}x{m} table (limit {_MAX_MARKOV_ENTRIES:,} entries); lower markov_order "
                f"or markov_successors"
            )
        self.vocab_size, self.order, self.seed = vocab_size, order, seed
        self.batch, self.seq, self.accum = batch, seq, accum
        rng = np.random.default_rng([seed, 0x4D41524B])
        if m == vocab_size:
            self.successors = np.broadcast_to(np.arange(m, dtype=np.int32), (n_states, m))
        else:
            # Sorted draws with replacement + 0..M-1: M distinct ascending tokens per state.
            draws = np.sort(rng.integers(0, vocab_size - m + 1, (n_states, m)), axis=1)
            self.successors = (draws + np.arange(m)).astype(np.int32)
        self.probs = rng.dirichlet(np.full(m, concentration), size=n_states)
        # Dirichlet rows with small alpha underflow to exact zeros; 0 ln 0 = 0.
        p = self.probs
        row_entropy_N = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)
        # State s -> (s mod V^(k-1)) V + t: drop the oldest token, append t.
        keep_N = np.arange(n_states, dtype=np.int64) % vocab_size ** (order - 1)
        self.stationary = _power_iteration(keep_N[:, None] * vocab_size + self.successors, p, n_states)
        self.entropy_floor = float(self.stationary @ row_entropy_N)
        self._cdf = np.cumsum(p, axis=1)
        self._start_cdf = np.cumsum(self.stationary)
        sparse = "" if m == vocab_size else f", {m} successors per state"
        self.description = (
            f"markov order {order} over V={vocab_size}{sparse}, Dirichlet({concentration}) rows, seed {seed}"
        )

    def prob(self, state, token) -> np.ndarray:
        """P[next = token | state], float64, elementwise over broadcast ``state`` and ``token``."""
        state, token = np.broadcast_arrays(np.asarray(state), np.asarray(token))
        hit = self.successors[state] == token[..., None]
        return np.sum(np.where(hit, self.probs[state], 0.0), axis=-1)

    def sample(self, u_RL: np.ndarray, length: int) -> np.ndarray:
        """[R, length] int64 tokens, one row per row of uniforms ``u_RL`` in [0, 1).

        ``u_RL[:, 0]`` picks the start state from the stationary distribution
        (its digits are the first ``order`` tokens, oldest first); ``u_RL[:, j]``
        for j >= 1 picks token ``order - 1 + j`` from its state's successors.
        Needs ``L >= 1 + max(length - order, 0)`` uniforms per row.
        """
        v, k = self.vocab_size, self.order
        rows = u_RL.shape[0]
        m = self.successors.shape[1]
        state = np.minimum(np.searchsorted(self._start_cdf, u_RL[:, 0], side="right"), v**k - 1)
        out = np.empty((rows, length), np.int64)
        first = [(state // v**j) % v for j in reversed(range(k))]
        out[:, : min(k, length)] = np.stack(first, axis=1)[:, :length]
        for i in range(k, length):
            j = (self._cdf[state] < u_RL[:, i - k + 1, None]).sum(axis=1)
            j = np.minimum(j, m - 1)  # rounding in the cdf's last entry
            tok = self.successors[state, j].astype(np.int64)
            out[:, i] = tok
            state = (state % v ** (k - 1)) * v + tok if k > 1 else tok
        return out

    def rows_at(self, step: int, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (flat indices into A*B) of step ``step``: [R, S+1] int64."""
        length = self.seq + 1
        width = 1 + max(length - self.order, 0)
        u_RL = np.empty((len(rows), width))
        for i, row in enumerate(rows):
            u_RL[i] = _row_rng(self.seed, step, int(row)).random(width)
        return self.sample(u_RL, length)


def list_text_files(path: str) -> list[str]:
    if not path:
        raise ValueError("dataset_type=text needs dataset_path (a file, directory or glob)")
    if os.path.isdir(path):
        files = sorted(
            os.path.join(root, f) for root, _, names in os.walk(path) for f in names
            if f.endswith(TEXT_SUFFIXES)
        )
        where = f"directory {path!r}"
    elif any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        where = f"glob {path!r}"
    elif os.path.isfile(path):
        files, where = [path], f"file {path!r}"
    else:
        raise FileNotFoundError(f"dataset_path={path!r}: no such file or directory")
    if not files:
        raise ValueError(f"dataset_path: {where} matches no files")
    bad = [f for f in files if not f.endswith(TEXT_SUFFIXES)]
    if bad:
        raise ValueError(f"dataset_path: {bad[0]!r} is not one of {TEXT_SUFFIXES}")
    return files


def _read_documents(file: str):
    """Yield the text documents of one file."""
    if file.endswith(".txt"):
        with open(file, encoding="utf-8", errors="replace") as f:
            yield f.read()
    elif file.endswith(".jsonl"):
        with open(file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{file}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f"{file}:{lineno}: expected an object with a string 'text' field")
                yield record["text"]
    else:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{file}: reading .parquet needs pyarrow (pip install pyarrow)") from None
        table = pq.read_table(file, columns=["text"])
        yield from table.column("text").to_pylist()


class _ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; document separator 0 (NUL, absent from text)."""

    vocab_size = 256
    eos_id = 0
    name = "bytes"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


class _JsonTokenizer:
    """A HuggingFace ``tokenizer.json`` through the ``tokenizers`` package."""

    _EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer_path={path!r}: no such file")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(
                "tokenizer_path needs the 'tokenizers' package (pip install 'dropless[text]')"
            ) from None
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"tokenizer_path={path!r} is not a tokenizer.json: {e}") from None
        self.vocab_size = self._tok.get_vocab_size()
        ids = [self._tok.token_to_id(n) for n in self._EOS_NAMES]
        self.eos_id = next((i for i in ids if i is not None), None)
        self.name = os.path.basename(path)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, np.int32)


def make_tokenizer(tokenizer_path: str):
    """The tokenizer of ``tokenizer_path`` (a ``tokenizer.json``), or UTF-8 bytes if empty.

    It has ``vocab_size``, ``eos_id`` (None if it names no end-of-text token),
    ``name`` and ``encode(text) -> int32 ids``.

    Raises:
      FileNotFoundError / ValueError: as ``TextSource``.
    """
    return _JsonTokenizer(tokenizer_path) if tokenizer_path else _ByteTokenizer()


def token_pieces(file: str, tok):
    """Yield one int32 array per document of ``file``: its ids, then the end-of-text id.

    The one definition of the text stream: ``TextSource`` concatenates these
    pieces over its files in order, and ``dropless tokenize`` writes the same
    concatenation to a ``.npy`` file, so both give the same windows.
    """
    eos = [] if tok.eos_id is None else [np.array([tok.eos_id], np.int32)]
    for doc in _read_documents(file):
        yield np.concatenate([tok.encode(doc), *eos])


def _tokenize(files: list[str], tokenizer_path: str, vocab_size: int) -> tuple[np.ndarray, str]:
    """(All documents of ``files`` as one int32 token array, the tokenizer's name)."""
    tok = make_tokenizer(tokenizer_path)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tok.name} has {tok.vocab_size} tokens but vocab_size={vocab_size}")
    pieces = [piece for file in files for piece in token_pieces(file, tok)]
    return (np.concatenate(pieces) if pieces else np.zeros(0, np.int32)), tok.name


def _token_file(files: list[str], tokenizer_path: str) -> np.memmap:
    """The one ``.npy`` file of ``files``, memory-mapped (nothing is read yet).

    Raises:
      ValueError: other files beside it, a tokenizer given, or not a 1-D integer array.
    """
    if len(files) != 1:
        raise ValueError(f"dataset_path: a .npy token file must be the only file; it matches "
                         f"{len(files)} ({files[0]!r}, {files[1]!r}, ...)")
    if tokenizer_path:
        raise ValueError(f"tokenizer_path={tokenizer_path!r} does not apply to {files[0]!r}: "
                         "a .npy file holds token ids already")
    try:
        tokens = np.load(files[0], mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise ValueError(f"{files[0]}: not a plain .npy array ({e})") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{files[0]}: token ids must be a 1-D integer array, "
                         f"got shape {tokens.shape} of {tokens.dtype}")
    return tokens


class TextSource(_RowSource):
    """Local text packed into S+1-token windows; ``entropy_floor`` unknown (None).

    Raises:
      FileNotFoundError: dataset_path or tokenizer_path does not exist.
      ValueError: no usable files, malformed records, too little text for one
        window, or token ids outside ``vocab_size``.
    """

    def __init__(self, cfg: DataConfig, vocab_size: int, *, batch, seq, accum=1):
        files = list_text_files(cfg.dataset_path)
        self.vocab_size = vocab_size
        if any(f.endswith(".npy") for f in files):
            self.tokens, kind = _token_file(files, cfg.tokenizer_path), "pre-tokenized"
        else:
            self.tokens, kind = _tokenize(files, cfg.tokenizer_path, vocab_size)
        self._checked = not isinstance(self.tokens, np.memmap)  # ids checked as windows are read
        self.num_windows = (len(self.tokens) - 1) // seq if len(self.tokens) > seq else 0
        if self.num_windows == 0:
            raise ValueError(
                f"dataset_path={cfg.dataset_path!r}: {len(self.tokens)} tokens, fewer than one "
                f"window of max_target_length+1={seq + 1}"
            )
        self.seed, self.batch, self.seq, self.accum = cfg.data_seed, batch, seq, accum
        self.entropy_floor = None
        self.description = (
            f"text: {len(files)} file(s), {len(self.tokens):,} {kind} tokens, "
            f"{self.num_windows:,} windows of {seq}"
        )
        self._perm_epoch, self._perm = -1, None

    def _window_order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch, 0x74657874]).permutation(
                self.num_windows
            )
            self._perm_epoch = epoch
        return self._perm

    def rows_at(self, step: int, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (flat indices into A*B) of step ``step``: [R, S+1] int32.

        Row r is window ``step * A*B + r`` of the epoch-by-epoch window order;
        only those windows are read.
        """
        per_step = self.accum * self.batch
        out = np.empty((len(rows), self.seq + 1), np.int32)
        for i, row in enumerate(rows):
            epoch, j = divmod(step * per_step + int(row), self.num_windows)
            start = self._window_order(epoch)[j] * self.seq
            window = self.tokens[start : start + self.seq + 1]
            if not self._checked and (window.min() < 0 or window.max() >= self.vocab_size):
                raise ValueError(
                    f"{self.tokens.filename}: token ids in [{window.min()}, {window.max()}] at "
                    f"offset {start}, outside [0, vocab_size={self.vocab_size})"
                )
            out[i] = window
        return out


def global_batch_size(per_device_batch_size: float, num_devices: int, batch_shards: int,
                      shard_names: str = "batch") -> int:
    """Sequences per microbatch across all devices: per-device size x devices, whole and
    divisible by the ``batch_shards`` the batch is split over (named ``shard_names``).

    Raises:
      ValueError: a batch that is not a whole number >= 1, or does not split over the shards.
    """
    exact = per_device_batch_size * num_devices
    batch = int(round(exact))
    if batch < 1 or abs(batch - exact) > 1e-9:
        raise ValueError(f"per_device_batch_size={per_device_batch_size} x {num_devices} devices = "
                         f"{exact:g} is not a whole number of sequences >= 1")
    if batch % batch_shards:
        raise ValueError(f"global batch {batch} does not split over the {batch_shards} "
                         f"{shard_names} shards")
    return batch


def make_source(cfg: DataConfig, vocab_size: int, *, batch: int, seq: int, accum: int = 1):
    """The data source of ``cfg`` yielding ``Batch`` [accum, batch, seq] by ``batch_at(step)``.

    ``batch_at(step, seqs)`` makes only sequences ``seqs`` of each microbatch
    (``rows_at(step, rows)`` the flat rows), equal to those of the whole batch.

    The source has ``entropy_floor`` (nats per token, or None if unknown) and
    ``description`` (one line for humans).

    Raises:
      ValueError / FileNotFoundError: unknown dataset_type, bad paths or data.
    """
    if cfg.dataset_type not in DATASET_TYPES:
        raise ValueError(f"dataset_type={cfg.dataset_type!r} is not one of {DATASET_TYPES}")
    if batch < 1 or seq < 1 or accum < 1:
        raise ValueError(f"data: batch={batch}, seq={seq}, accum={accum} must all be >= 1")
    if cfg.dataset_type == "synthetic":
        return SyntheticSource(vocab_size, cfg.data_seed, batch=batch, seq=seq, accum=accum)
    if cfg.dataset_type == "markov":
        return MarkovSource(
            vocab_size, cfg.markov_order, cfg.markov_concentration, cfg.data_seed,
            batch=batch, seq=seq, accum=accum, successors=cfg.markov_successors,
        )
    return TextSource(cfg, vocab_size, batch=batch, seq=seq, accum=accum)
