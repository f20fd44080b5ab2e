"""Ragged row exchange between the ranks of one mesh axis, and its offset arithmetic.

Legend: R ranks on the exchange axis (``axis_name``), r this rank, N rows of
the operand, M rows of the output, D trailing features (any trailing shape),
C rows per (sender, receiver) chunk of the padded exchange.

Every rank holds a send buffer whose rows are grouped by destination rank
(rank 0's rows first). ``counts_RR[s, q]`` is how many rows rank s sends to
rank q; all ranks know the whole matrix (one ``all_gather`` of each rank's row).
A receiver stores the rows of its senders contiguously in sender order, in a
buffer of ``capacity`` rows: rows that would land at or past ``capacity`` do
not fit; they are not sent and are counted as overflow. ``layouts`` turns
the matrix into the four offset/size vectors of ``jax.lax.ragged_all_to_all``
for the outbound trip and for the return trip (the receiver sending one
result row back per row received, each landing where its input left the
sender's buffer). The same arithmetic serves both exchange implementations,
so CPU tests cover it:

* ``ragged``: ``jax.lax.ragged_all_to_all`` (XLA:GPU; XLA:CPU lacks it);
* ``padded``: the same contract built from ``jax.lax.all_to_all`` over
  fixed [R, C] chunks (any platform; C x R rows travel whatever the load).

``exchange`` wraps either in a custom VJP whose backward is the opposite trip:
the transpose of "send row i to (q, j)" is "send row j of q back to i", which
needs no scatter-add and keeps gradients as ragged as the forward.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

IMPLS = ("ragged", "padded")


class Layout(NamedTuple):
    """One trip of a ragged exchange, from this rank's point of view ([R] int32 each).

    input_offsets[q]: first row of the operand sent to rank q.
    send_sizes[q]: rows sent to rank q.
    output_offsets[q]: first row at which they land in rank q's output.
    recv_sizes[s]: rows received from rank s.

    Offsets of empty slices are 0, so no offset ever points past a buffer.
    """

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array


class Trips(NamedTuple):
    """Both trips of an exchange plus what the receiver needs to know.

    out: the outbound ``Layout`` (send buffer -> receive buffer).
    back: the return ``Layout`` (receive buffer -> the senders' send buffers).
    recv_rows: [] int32 rows this rank received; they fill rows [0, recv_rows).
    dropped_rows: [] int32 rows sent to this rank that land past this trip's
      window (did not fit, for the first window).
    wanted_rows: [] int32 rows sent to this rank, fitting or not.
    """

    out: Layout
    back: Layout
    recv_rows: jax.Array
    dropped_rows: jax.Array
    wanted_rows: jax.Array


def _exclusive_cumsum(x, axis):
    return jnp.cumsum(x, axis=axis) - x


def layouts(counts_RR, capacity, rank, first_row=0):
    """Offsets and sizes of both trips, with receive buffers of ``capacity`` rows.

    Args:
      counts_RR: [R, R] int32, ``counts_RR[s, q]`` rows rank s sends to rank q;
        each rank's send buffer holds its rows grouped by destination, in
        rank order, from row 0.
      capacity: rows of every receive buffer (static int).
      rank: this rank's index on the exchange axis ([] int32, traced is fine).
      first_row: which window of the receivers' row streams this trip carries
        (static int; a multiple of ``capacity``). Receiver q's stream is
        every row sent to q in sender order; a trip carries rows
        [first_row, first_row + capacity) of it, so trips with first_row 0,
        capacity, 2 x capacity, ... deliver a load larger than one buffer in
        rounds (``parallel.ep``'s ``ep_overflow_rounds``).

    Returns:
      ``Trips``. Rows from sender s sit in receiver q's stream from row
      ``sum_{s' < s} counts_RR[s', q]``; this trip delivers the part inside
      its window to receive-buffer row (stream row - first_row); the rest is
      cut (a whole tail past the window: later senders lose first).

    Raises:
      ValueError: counts_RR not square; capacity or first_row < 0.
    """
    if counts_RR.ndim != 2 or counts_RR.shape[0] != counts_RR.shape[1]:
        raise ValueError(f"counts_RR must be [R, R], got {counts_RR.shape}")
    if capacity < 0 or first_row < 0:
        raise ValueError(f"{capacity=} and {first_row=} must be >= 0")
    counts_RR = counts_RR.astype(jnp.int32)
    land_RR = _exclusive_cumsum(counts_RR, axis=0)  # where s's rows start in q's stream
    lo_RR = jnp.maximum(land_RR, first_row)  # first stream row of s inside the window
    hi_RR = jnp.minimum(land_RR + counts_RR, first_row + capacity)
    fit_RR = jnp.maximum(hi_RR - lo_RR, 0)  # rows of s this trip delivers to q
    skip_RR = lo_RR - land_RR  # rows of s for q that earlier windows carried
    start_RR = _exclusive_cumsum(counts_RR, axis=1) + skip_RR  # their first row in s's buffer
    at_RR = lo_RR - first_row  # where they land in q's receive buffer

    def trip(input_offsets, send_sizes, output_offsets, recv_sizes):
        zero_empty = lambda off, size: jnp.where(size > 0, off, 0)  # noqa: E731
        return Layout(
            zero_empty(input_offsets, send_sizes), send_sizes,
            zero_empty(output_offsets, send_sizes), recv_sizes,
        )

    out = trip(start_RR[rank], fit_RR[rank], at_RR[rank], fit_RR[:, rank])
    back = trip(at_RR[:, rank], fit_RR[:, rank], start_RR[:, rank], fit_RR[rank])
    recv_rows = jnp.sum(fit_RR[:, rank])
    wanted_rows = jnp.sum(counts_RR[:, rank])
    dropped_rows = jnp.maximum(wanted_rows - (first_row + capacity), 0)
    return Trips(out, back, recv_rows, dropped_rows, wanted_rows)


def _ragged(x_ND, out_rows, lay: Layout, axis_name):
    # zeros_like keeps the operand's varying mesh axes (the exchange axis and,
    # inside a larger mesh, the batch axes), which the output buffer must share.
    out_MD = jnp.zeros_like(x_ND, shape=(out_rows, *x_ND.shape[1:]))
    return jax.lax.ragged_all_to_all(
        x_ND, out_MD, lay.input_offsets, lay.send_sizes, lay.output_offsets, lay.recv_sizes,
        axis_name=axis_name,
    )


def _padded(x_ND, out_rows, lay: Layout, axis_name, chunk_rows):
    n = x_ND.shape[0]
    r = lay.send_sizes.shape[0]
    i_C = jnp.arange(chunk_rows, dtype=jnp.int32)
    src_RC = lay.input_offsets[:, None] + i_C
    src_RC = jnp.where(i_C < lay.send_sizes[:, None], src_RC, n)  # n: out of range -> zero row
    send_RCD = x_ND.at[src_RC].get(mode="fill", fill_value=0)
    recv_RCD = jax.lax.all_to_all(send_RCD, axis_name, 0, 0, tiled=True)
    # Where each sender's rows land here: its output_offsets entry for this rank.
    land_R = jax.lax.all_to_all(lay.output_offsets, axis_name, 0, 0, tiled=True)
    dst_RC = land_R[:, None] + i_C
    dst_RC = jnp.where(i_C < lay.recv_sizes[:, None], dst_RC, out_rows)  # dropped below
    out_MD = jnp.zeros((out_rows, *x_ND.shape[1:]), x_ND.dtype)
    return out_MD.at[dst_RC.reshape(r * chunk_rows)].set(
        recv_RCD.reshape(r * chunk_rows, *x_ND.shape[1:]), mode="drop"
    )


def _run(x_ND, out_rows, lay, axis_name, impl, chunk_rows):
    if impl == "ragged":
        return _ragged(x_ND, out_rows, lay, axis_name)
    return _padded(x_ND, out_rows, lay, axis_name, chunk_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 4, 5, 6))
def _exchange(x_ND, out_rows, out: Layout, back: Layout, axis_name, impl, chunk_rows):
    return _run(x_ND, out_rows, out, axis_name, impl, chunk_rows)


def _exchange_fwd(x_ND, out_rows, out, back, axis_name, impl, chunk_rows):
    return _exchange(x_ND, out_rows, out, back, axis_name, impl, chunk_rows), (back, x_ND.shape[0])


def _exchange_bwd(out_rows, axis_name, impl, chunk_rows, res, dy_MD):
    back, n = res
    # Rows that were not sent (or did not fit) get zero gradient: the return
    # trip writes only the rows that went out.
    dx_ND = _run(dy_MD, n, back, axis_name, impl, chunk_rows)
    return dx_ND, None, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def exchange(x_ND, out_rows, trip: Layout, reverse: Layout, *, axis_name, impl, chunk_rows):
    """Send row slices of ``x_ND`` to the ranks of ``axis_name`` (call inside ``shard_map``).

    Args:
      x_ND: [N, ...] rows to send, any dtype; differentiable when floating.
      out_rows: M, rows of the output buffer (static).
      trip: this trip's ``Layout`` (from ``layouts``).
      reverse: the opposite trip's ``Layout``; the backward pass runs it.
      axis_name: the mesh axis to exchange over.
      impl: "ragged" (``ragged_all_to_all``, GPU) or "padded" (``all_to_all``).
      chunk_rows: C, static upper bound of any ``send_sizes`` entry ("padded" only).

    Returns:
      [M, ...] with rows from rank s at ``trip.recv_sizes``-sized slices,
      where the sender's ``output_offsets`` put them; zeros elsewhere.

    Raises:
      ValueError: unknown ``impl``.
    """
    if impl not in IMPLS:
        raise ValueError(f"exchange {impl=} is not one of {IMPLS}")
    return _exchange(x_ND, out_rows, trip, reverse, axis_name, impl, chunk_rows)


def resolve_impl(impl, platform):
    """"auto" -> "ragged" on GPU, "padded" elsewhere; other names pass through.

    Raises:
      ValueError: unknown name, or "ragged" on a platform without it.
    """
    if impl == "auto":
        return "ragged" if platform in ("gpu", "cuda", "rocm") else "padded"
    if impl not in IMPLS:
        raise ValueError(f"ep_exchange={impl!r} is not one of {('auto', *IMPLS)}")
    if impl == "ragged" and platform == "cpu":
        raise ValueError("ep_exchange='ragged' needs a GPU: XLA:CPU has no ragged_all_to_all; "
                         "use 'padded' or 'auto'")
    return impl
