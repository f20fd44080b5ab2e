"""Expert parallelism: deduplicated dispatch and combine of routed tokens over a mesh axis.

Legend: T tokens on this rank, K experts per token, D features, E experts,
R ranks on the ``expert`` axis, L = E/R experts per rank (rank q holds experts
[q*L, (q+1)*L)), S rows of the send buffer, Q rows of the receive buffer,
P rows of the expert-sorted buffer, G groups of a grouped matmul.

``routed_experts`` runs ``expert_fn`` (the grouped SwiGLU of ``nn.moe``) on
the tokens routed to each expert and returns ``sum_k w_k * FFN_{e_k}(x)`` per
token. Without a mesh (or with R = 1) it is the local, single-device path:
sort copies by expert, grouped matmuls, weighted unsort. With R > 1, inside
``shard_map`` over the mesh, each rank::

    dispatch  a token goes once to each rank holding >= 1 of its K experts,
              with those experts' local ids and router weights (the others
              marked absent): rows sorted by destination rank, the [R, R]
              row counts all-gathered, one exchange (``parallel.exchange``)
    experts   the receiver expands each row to its local experts, sorts the
              copies by expert and runs the grouped matmuls
    combine   the receiver sums each row's local experts, weighted, into one
              row; the return trip brings it home, where the token sums its
              (at most min(K, R)) returned rows

so a token whose experts share a rank crosses the network once, not once
per expert (the ``rows_saved`` stat counts the difference).

Buffers (static sizes; ``Capacity``). The unit of the *balanced load* is the
received token row: ``T * min(K, R)`` rows, what every rank receives when the
load is even and no two of a token's experts share a rank (the worst case of
dedup; with per-expert sending it is the balanced load as well). A receive
buffer holds ``ragged_buffer_factor`` x that many rows, at most the exact
worst case ``R * T`` (every token of every rank sent here), which factor -1
selects. The expert-sorted buffer behind it likewise holds factor x the
balanced ``T * K`` expert copies (worst case ``R * T * min(K, L)``).

Overflow: rows that do not fit, and rows some of whose copies do not fit in
the expert buffer, are not computed; their tokens get a partial sum. They are
counted (``overflow_tokens``, summed over all ranks) together with the
smallest factor that would have held everything (``buffer_factor_needed``), so
the trainer can skip the step on device and report it; with factor -1 overflow
cannot happen.

Extra rounds (``ep_overflow_rounds`` = n > 0) deliver an overflowing load
instead of dropping it. Each receiver's rows form one stream in sender
order; round j carries rows [j*Q, (j+1)*Q) of it (``exchange.layouts``'s
``first_row``) through the same buffers, and each round's expert copies,
sorted once, are computed in windows of P rows (``compact_plan``'s
``first``). Round j > 0 and window i > 0 sit under nested ``lax.cond``s:
they run only when some rank's load reaches them (the row-round test is the
same on every rank, from the all-gathered counts and a max over the batch
axes), so a load that fits skips their work and evaluates one condition for
the rounds and one for the windows (their cost: ``benchmarks/ep_rounds.py``),
and a load up to (n+1) x the buffers is computed whole, exactly as with
factor -1 (same outputs and gradients).
Only what lies past n+1 windows still counts as overflow; ``extra_rounds``
reports the passes run.

Pipeline chunks (``ep_pipeline_chunks`` = c > 1): each rank splits its T
tokens into c contiguous chunks of T/c and runs dispatch, experts and combine
on each chunk alone, with buffers sized for T/c tokens (the factor applies per
chunk). The chunks do not depend on each other, so XLA's scheduler may run
one chunk's exchange while another's grouped matmuls run. A token's result
does not depend on its chunk (the same rows, the same per-row products); the
stats add up over chunks (``buffer_factor_needed`` is the largest chunk's,
``extra_rounds`` the sum). With one expert rank there is no exchange to
overlap, and the load runs whole.
"""

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from dropless.ops import permute as permute_ops
from dropless.parallel import exchange as exchange_lib

EXACT = -1.0  # ragged_buffer_factor meaning "exact worst case"


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Where and how an MoE layer runs expert-parallel.

    mesh: the device mesh (explicit; never a global).
    buffer_factor: receive buffers as a multiple of the balanced load, or -1
      (exact worst case). See the module docstring.
    exchange: "ragged" | "padded" (``parallel.exchange``); resolve "auto" with
      ``exchange.resolve_impl`` before building this.
    expert_axis: mesh axis the experts are split over.
    token_axes: mesh axes the tokens are split over (batch x expert).
    overflow_rounds: extra rounds for a load that overflows the buffers (see
      the module docstring); 0 leaves overflow to the trainer's skip.
    pipeline_chunks: token chunks per rank, each exchanged and computed on its
      own (module docstring); 1: the whole load at once.

    Raises:
      ValueError: factor neither -1 nor >= 1; rounds < 0; chunks < 1; unknown
        exchange; axes not in the mesh.
    """

    mesh: Mesh
    buffer_factor: float = 2.0
    exchange: str = "padded"
    expert_axis: str = "expert"
    token_axes: tuple[str, ...] = ("data", "fsdp", "expert")
    overflow_rounds: int = 0
    pipeline_chunks: int = 1

    def __post_init__(self):
        if self.buffer_factor != EXACT and self.buffer_factor < 1:
            raise ValueError(f"ragged_buffer_factor={self.buffer_factor} must be -1 or >= 1")
        if self.overflow_rounds < 0:
            raise ValueError(f"ep_overflow_rounds={self.overflow_rounds} must be >= 0")
        if self.pipeline_chunks < 1:
            raise ValueError(f"ep_pipeline_chunks={self.pipeline_chunks} must be >= 1")
        if self.exchange not in exchange_lib.IMPLS:
            raise ValueError(f"{self.exchange=} is not one of {exchange_lib.IMPLS}")
        for axis in (self.expert_axis, *self.token_axes):
            if axis not in self.mesh.axis_names:
                raise ValueError(f"axis {axis!r} is not in the mesh {self.mesh.axis_names}")

    @property
    def ranks(self) -> int:
        return self.mesh.shape[self.expert_axis]

    def live(self, axes) -> tuple[str, ...]:
        """The axes of ``axes`` with more than one device (size-1 axes split nothing)."""
        return tuple(a for a in axes if self.mesh.shape[a] > 1)

    @property
    def token_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.token_axes)


def from_config(mesh: Mesh, cfg) -> ExpertParallel:
    """The ``ExpertParallel`` of a ``MeshConfig`` on ``mesh``; "auto" exchange resolved.

    Raises:
      ValueError: as ``ExpertParallel``, or "ragged" on a CPU mesh.
    """
    platform = mesh.devices.flat[0].platform
    return ExpertParallel(
        mesh, buffer_factor=float(cfg.ragged_buffer_factor),
        exchange=exchange_lib.resolve_impl(cfg.ep_exchange, platform),
        overflow_rounds=int(cfg.ep_overflow_rounds),
        pipeline_chunks=int(cfg.ep_pipeline_chunks),
    )


class Capacity(NamedTuple):
    """Static buffer sizes of one rank (rows).

    send: S = T*min(K, R), every (token, rank) pair a token can need.
    recv: Q, the receive buffer.
    expert: P, the expert-sorted buffer (alignment padding included; a
      multiple of the alignment, so windows of it cut no aligned group badly).
    balanced_rows: T*min(K, R); balanced_copies: T*K (the units of the factor).
    """

    send: int
    recv: int
    expert: int
    balanced_rows: int
    balanced_copies: int


def capacity(tokens, k, ranks, local_experts, factor, alignment=1) -> Capacity:
    """Buffer sizes for ``tokens`` per rank; ``factor`` -1 gives the exact worst case.

    Raises:
      ValueError: factor neither -1 nor >= 1.
    """
    if factor != EXACT and factor < 1:
        raise ValueError(f"ragged_buffer_factor={factor} must be -1 or >= 1")
    send = tokens * min(k, ranks)
    balanced_copies = tokens * k
    worst_rows = ranks * tokens
    if factor == EXACT:
        recv = worst_rows
        expert = worst_rows * min(k, local_experts)
    else:
        recv = min(worst_rows, math.ceil(factor * send))
        expert = min(recv * min(k, local_experts), math.ceil(factor * balanced_copies))
    expert = -(-(expert + local_experts * (alignment - 1)) // alignment) * alignment
    return Capacity(send, recv, expert, send, balanced_copies)


class EPStats(NamedTuple):
    """Exchange statistics of one call, summed over all ranks ([] each).

    overflow_tokens: int32 token rows not fully computed for lack of buffer.
    buffer_factor_needed: float32 smallest ``ragged_buffer_factor`` that would
      have held this call's load on every rank (0 without an exchange).
    rows_sent: int32 token rows sent to other ranks (deduplicated).
    rows_saved: int32 rows per-expert sending would have sent on top of them;
      bytes saved = rows_saved * D * itemsize.
    extra_rounds: int32 extra passes this call ran for what overflowed the
      first one (exchange rounds plus grouped-matmul passes; max over ranks).
    """

    overflow_tokens: jax.Array
    buffer_factor_needed: jax.Array
    rows_sent: jax.Array
    rows_saved: jax.Array
    extra_rounds: jax.Array

    @staticmethod
    def zeros() -> "EPStats":
        z = jnp.zeros((), jnp.int32)
        return EPStats(z, jnp.zeros((), jnp.float32), z, z, z)

    @staticmethod
    def of_chunks(chunks: "list[EPStats]") -> "EPStats":
        """The stats of one call made of ``chunks`` (pipeline chunks): counts add up, the
        factor needed is the largest chunk's."""
        total = lambda field: sum(getattr(c, field) for c in chunks)  # noqa: E731
        return EPStats(
            overflow_tokens=total("overflow_tokens"),
            buffer_factor_needed=functools.reduce(
                jnp.maximum, [c.buffer_factor_needed for c in chunks]),
            rows_sent=total("rows_sent"), rows_saved=total("rows_saved"),
            extra_rounds=total("extra_rounds"),
        )


def compact_plan(keys_TK, groups, rows, alignment=1, first=0,
                 full: permute_ops.PermutePlan | None = None) -> permute_ops.PermutePlan:
    """``make_plan`` over ``groups`` groups, key ``groups`` meaning "absent", cut to a window.

    The window is rows [first, first + rows) of the full expert-sorted order
    (static ints); several windows of one ``full`` plan split a load larger
    than one buffer into passes. Copies keyed ``groups`` and copies sorted
    outside the window get row ``rows`` (out of the buffer: they read as
    zeros); group sizes are cut to the window.

    Args:
      full: ``permute_ops.make_plan(keys_TK, groups + 1, alignment)`` when the
        caller already has it (windows of one load share it).

    Returns:
      PermutePlan with P = ``rows`` (at most the full plan's rows),
      ``group_sizes_E`` [groups] summing to <= rows, ``tokens_per_expert_E``
      [groups] uncut counts.
    """
    if full is None:
        full = permute_ops.make_plan(keys_TK, groups + 1, alignment)
    c = keys_TK.size
    p_full = full.copy_of_row_P.shape[0]
    rows = min(rows, p_full)
    real = keys_TK.reshape(-1) < groups
    r_C = full.row_of_copy_C - first
    row_of_copy_C = jnp.where(real & (r_C >= 0) & (r_C < rows), r_C, rows)
    real_rows = jnp.sum(full.group_sizes_E[:groups])
    window_P = full.copy_of_row_P[first:first + rows]
    if window_P.shape[0] < rows:
        window_P = jnp.pad(window_P, (0, rows - window_P.shape[0]), constant_values=c)
    row_ids = first + jnp.arange(rows, dtype=jnp.int32)
    copy_of_row_P = jnp.where(row_ids < real_rows, window_P, c)
    ends_G = jnp.clip(jnp.cumsum(full.group_sizes_E[:groups]) - first, 0, rows)
    group_sizes_G = jnp.diff(ends_G, prepend=0).astype(jnp.int32)
    return permute_ops.PermutePlan(
        row_of_copy_C, copy_of_row_P, group_sizes_G, full.tokens_per_expert_E[:groups]
    )


def local_experts(x_TD, experts_TK, weights_TK, expert_weights, expert_fn, num_experts,
                  alignment=1):
    """Single-device routed experts: sort copies by expert, grouped matmuls, weighted unsort."""
    plan = permute_ops.make_plan(experts_TK, num_experts, alignment)
    y_PD = expert_fn(permute_ops.permute(x_TD, plan), plan.group_sizes_E, expert_weights)
    return permute_ops.unpermute(y_PD, weights_TK, plan)


def _lead_slots(dest_TK):
    """[T, K] bool: slot k is the first of its token going to rank dest_TK[t, k]."""
    k = dest_TK.shape[1]
    earlier_KK = jnp.tril(jnp.ones((k, k), bool), -1)  # [k, j]: j < k
    same_TKK = dest_TK[:, :, None] == dest_TK[:, None, :]
    return ~jnp.any(same_TKK & earlier_KK, axis=-1)


class _Sent(NamedTuple):
    x_SD: jax.Array
    meta_SM: jax.Array  # [S, 2K] float32: weights | local expert ids (L = absent)
    lead_TK: jax.Array
    plan: permute_ops.PermutePlan
    counts_2R: jax.Array  # rows and expert copies per destination rank


def _dispatch_send(x_TD, experts_TK, weights_TK, ranks, per_rank, send_rows):
    """Sender side: one row per (token, destination rank), sorted by rank."""
    t, k = experts_TK.shape
    dest_TK = experts_TK // per_rank
    lead_TK = _lead_slots(dest_TK)
    plan = compact_plan(jnp.where(lead_TK, dest_TK, ranks), ranks, send_rows)
    x_SD = permute_ops.permute(x_TD, plan)
    slot_S = plan.copy_of_row_P  # t*K + k of the lead slot, t*K (= C) on empty rows
    token_S = slot_S // k
    dest_S = dest_TK.reshape(-1).at[slot_S].get(mode="fill", fill_value=ranks)
    exp_SK = experts_TK.at[token_S].get(mode="fill", fill_value=0)
    mine_SK = (exp_SK // per_rank == dest_S[:, None]) & (token_S < t)[:, None]
    local_SK = jnp.where(mine_SK, exp_SK % per_rank, per_rank)
    w_SK = jnp.where(mine_SK, weights_TK.astype(jnp.float32).at[token_S].get(
        mode="fill", fill_value=0), 0.0)
    meta_SM = jnp.concatenate([w_SK, local_SK.astype(jnp.float32)], axis=1)
    copies_R = jnp.bincount(dest_TK.reshape(-1), length=ranks).astype(jnp.int32)
    counts_2R = jnp.stack([plan.tokens_per_expert_E, copies_R])
    return _Sent(x_SD, meta_SM, lead_TK, plan, counts_2R)


def _recomputed(fn):
    """``fn`` rematerialised in the backward pass (static int argument).

    Used for the extra rounds and windows under ``lax.cond``: the linearised
    cond returns every branch's residuals, zero-filled when the branch was
    not taken, so without remat each idle round would cost a full set of
    activation buffers; with it the residuals are the round's inputs, which
    exist anyway. A round that runs is computed twice (rare by design).
    """
    return jax.checkpoint(fn, static_argnums=(0,), policy=jax.checkpoint_policies.nothing_saveable)


def _receive_and_compute(recv_x_QD, recv_meta_QM, recv_rows, expert_weights, expert_fn,
                         per_rank, cap: Capacity, alignment, passes):
    """Receiver side: expand rows to local experts, grouped matmuls, weighted row sums.

    The expert copies are sorted once and computed in windows of ``cap.expert``
    rows: the first always, each of the next ``passes - 1`` only when the copies
    reach into it (``lax.cond``: a load that fits costs one pass).

    Returns (out_QD, rows whose copies did not all fit in ``passes`` windows,
    extra passes run).
    """
    q, m = recv_meta_QM.shape
    k = m // 2
    w_QK = recv_meta_QM[:, :k]
    local_QK = jax.lax.stop_gradient(recv_meta_QM[:, k:]).astype(jnp.int32)
    valid_Q = jnp.arange(q) < recv_rows
    local_QK = jnp.where(valid_Q[:, None], local_QK, per_rank)
    full = permute_ops.make_plan(local_QK, per_rank + 1, alignment)
    sorted_rows = jnp.sum(full.group_sizes_E[:per_rank])

    def window(i):
        plan = compact_plan(local_QK, per_rank, cap.expert, alignment, i * cap.expert, full)
        y_PD = expert_fn(permute_ops.permute(recv_x_QD, plan), plan.group_sizes_E,
                         expert_weights)
        return permute_ops.unpermute(y_PD, w_QK, plan)

    out_QD = window(0)
    # Windows a load can reach (static); window i runs when the copies reach it. The
    # conditions nest, so a load that fits evaluates one.
    reachable = [i for i in range(1, passes) if i * cap.expert < full.copy_of_row_P.shape[0]]

    def windows_from(n):
        if n == len(reachable):
            return jnp.zeros_like(out_QD), jnp.zeros((), jnp.int32)
        i = reachable[n]

        def run():
            rest, extra = windows_from(n + 1)
            return _recomputed(window)(i) + rest, extra + 1

        return jax.lax.cond(sorted_rows > i * cap.expert, run,
                            lambda: (jnp.zeros_like(out_QD), jnp.zeros((), jnp.int32)))

    more_QD, extra = windows_from(0)
    out_QD = out_QD + more_QD
    lost_QK = (local_QK < per_rank) & (full.row_of_copy_C.reshape(q, k) >= passes * cap.expert)
    return out_QD, jnp.sum(jnp.any(lost_QK, axis=1)).astype(jnp.int32), extra


def _per_rank(x_TD, experts_TK, weights_TK, expert_weights, *, expert_fn, num_experts,
              alignment, ep: ExpertParallel):
    """The body run by every rank inside ``shard_map``: the whole load, or each of
    ``ep.pipeline_chunks`` chunks of it on its own (module docstring)."""
    # The weights are replicated over the batch axes, the tokens are not; a
    # custom-VJP expert_fn must see both vary alike (the weight gradient's
    # transpose of this cast is the psum over the batch axes).
    batch_axes = ep.live(a for a in ep.token_axes if a != ep.expert_axis)
    if batch_axes:
        expert_weights = tuple(jax.lax.pcast(w, batch_axes, to="varying") for w in expert_weights)
    if ep.ranks == 1:
        out_TD = local_experts(x_TD, experts_TK, weights_TK, expert_weights, expert_fn,
                               num_experts, alignment)
        return out_TD, EPStats.zeros()
    n, t = ep.pipeline_chunks, x_TD.shape[0]
    one = functools.partial(_exchange_and_compute, expert_weights=expert_weights,
                            expert_fn=expert_fn, num_experts=num_experts, alignment=alignment,
                            ep=ep)
    if n == 1:
        return one(x_TD, experts_TK, weights_TK)
    if t % n:
        raise ValueError(f"ep_pipeline_chunks={n} does not divide the {t} tokens of each rank")
    c = t // n
    outs, stats = zip(*(one(x_TD[i * c:(i + 1) * c], experts_TK[i * c:(i + 1) * c],
                            weights_TK[i * c:(i + 1) * c]) for i in range(n)))
    return jnp.concatenate(outs), EPStats.of_chunks(list(stats))


def _exchange_and_compute(x_TD, experts_TK, weights_TK, *, expert_weights, expert_fn,
                          num_experts, alignment, ep: ExpertParallel):
    """Dispatch, experts and combine of one rank's ``x_TD`` over ``ep.ranks`` > 1 ranks."""
    ranks = ep.ranks
    axis, (t, k) = ep.expert_axis, experts_TK.shape
    per_rank = num_experts // ranks
    cap = capacity(t, k, ranks, per_rank, ep.buffer_factor, alignment)
    sent = _dispatch_send(x_TD, experts_TK, weights_TK, ranks, per_rank, cap.send)
    counts_R2R = jax.lax.all_gather(sent.counts_2R, axis)
    rank = jax.lax.axis_index(axis)
    move = functools.partial(exchange_lib.exchange, axis_name=axis, impl=ep.exchange,
                             chunk_rows=min(t, cap.recv))
    passes = 1 + ep.overflow_rounds
    axes = ep.live(ep.token_axes)

    def row_round(j):
        """Deliver window j of every receiver's rows, compute, bring the results home."""
        trips = exchange_lib.layouts(counts_R2R[:, 0], cap.recv, rank, j * cap.recv)
        recv_x_QD = move(sent.x_SD, cap.recv, trips.out, trips.back)
        recv_meta_QM = move(sent.meta_SM, cap.recv, trips.out, trips.back)
        out_QD, lost_rows, extra = _receive_and_compute(
            recv_x_QD, recv_meta_QM, trips.recv_rows, expert_weights, expert_fn, per_rank, cap,
            alignment, passes,
        )
        # Each window's rows return to their own rows of the send buffer.
        return move(out_QD, cap.send, trips.back, trips.out), lost_rows, extra, trips

    back_SD, lost_rows, extra, trips = row_round(0)
    # Extra rounds, all ranks of the exchange agreeing (counts are all-gathered;
    # the max over the batch axes makes the branch the same everywhere). Round j
    # runs when some receiver's rows reach its window; the conditions nest, so a
    # load that fits evaluates one.
    busiest = jax.lax.pmax(jnp.max(jnp.sum(counts_R2R[:, 0], axis=0)), axes)
    reachable = [j for j in range(1, passes) if j * cap.recv < ranks * t]

    def skip():  # zeros_like keeps the operands' varying mesh axes
        return jnp.zeros_like(back_SD), jnp.zeros_like(lost_rows), jnp.zeros_like(extra)

    def rounds_from(n):
        if n == len(reachable):
            return skip()
        j = reachable[n]

        def run():
            b_SD, lost, ext = _recomputed(lambda j: row_round(j)[:3])(j)
            rest_SD, rest_lost, rest_ext = rounds_from(n + 1)
            return b_SD + rest_SD, lost + rest_lost, ext + rest_ext + 1

        return jax.lax.cond(busiest > j * cap.recv, run, skip)

    more_SD, more_lost, more_extra = rounds_from(0)
    back_SD, lost_rows, extra = back_SD + more_SD, lost_rows + more_lost, extra + more_extra
    dropped_rows = jnp.maximum(trips.wanted_rows - passes * cap.recv, 0)
    out_TD = permute_ops.unpermute(back_SD, sent.lead_TK.astype(jnp.float32), sent.plan)
    copies_wanted = jnp.sum(counts_R2R[:, 1, rank])
    needed = jnp.maximum(trips.wanted_rows / cap.balanced_rows,
                         copies_wanted / cap.balanced_copies).astype(jnp.float32)
    remote_R = jnp.arange(ranks) != rank
    rows_sent = jnp.sum(jnp.where(remote_R, sent.counts_2R[0], 0))
    copies_sent = jnp.sum(jnp.where(remote_R, sent.counts_2R[1], 0))
    stats = EPStats(
        overflow_tokens=jax.lax.psum(dropped_rows + lost_rows, axes),
        buffer_factor_needed=jax.lax.pmax(needed, axes),
        rows_sent=jax.lax.psum(rows_sent, axes),
        rows_saved=jax.lax.psum(copies_sent - rows_sent, axes),
        extra_rounds=jax.lax.pmax(extra, axes),
    )
    return out_TD, stats


def routed_experts(x_TD, experts_TK, weights_TK, expert_weights, expert_fn: Callable, *,
                   num_experts: int, alignment: int = 1, ep: ExpertParallel | None = None):
    """``out[t] = sum_k weights_TK[t, k] * expert_fn(x[t])`` of expert ``experts_TK[t, k]``.

    Args:
      x_TD: [T, D] tokens (global; split over ``ep.token_axes`` when ``ep`` is given).
      experts_TK: [T, K] int32 expert ids in [0, E).
      weights_TK: [T, K] float32 combine weights.
      expert_weights: tuple of [E, ...] arrays, split over the expert axis.
      expert_fn: ``(x_PD, group_sizes_G, weights) -> y_PD`` for the experts
        whose weights it is given (G of them), rows grouped in expert order;
        rows past ``sum(group_sizes_G)`` must come out as zeros.
      num_experts: E. alignment: round each expert's rows up to a multiple.
      ep: expert parallelism, or None for the single-device path.

    Returns:
      ``(out_TD, EPStats)``; out_TD [T, D] in x's dtype, sharded like x.

    Raises:
      ValueError: E not divisible by the expert ranks, or T by the token shards.
    """
    if ep is None:
        out_TD = local_experts(x_TD, experts_TK, weights_TK, expert_weights, expert_fn,
                               num_experts, alignment)
        return out_TD, EPStats.zeros()
    if num_experts % ep.ranks:
        raise ValueError(f"num_experts={num_experts} is not divisible by the {ep.ranks} "
                         f"ranks of mesh axis {ep.expert_axis!r}")
    if x_TD.shape[0] % ep.token_shards:
        raise ValueError(f"{x_TD.shape[0]} tokens do not split over mesh axes "
                         f"{ep.token_axes} ({ep.token_shards} shards)")
    # Specs name only axes of size > 1: then nothing varies over a size-1 axis
    # and one device runs exactly the local program (no casts, no trivial psums).
    tokens = P(ep.live(ep.token_axes) or None)
    experts = P(ep.live((ep.expert_axis,)) or None)
    body = functools.partial(_per_rank, expert_fn=expert_fn, num_experts=num_experts,
                             alignment=alignment, ep=ep)
    fn = jax.shard_map(
        body, mesh=ep.mesh,
        in_specs=(tokens, tokens, tokens, tuple(experts for _ in expert_weights)),
        out_specs=(tokens, P()),
    )
    return fn(x_TD, experts_TK, weights_TK, tuple(expert_weights))
