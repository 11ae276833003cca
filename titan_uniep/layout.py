"""The one definition of where every routed row goes.

Every schedule (reference, sequential, fused; forward and backward) places rows
with this module and nothing else, which is what makes their results bitwise
comparable: the scoreboard of a fused kernel decides only *when* a tile may
run, never *where* a row lands.

Terms (EP group of ``W`` ranks, ``E`` experts, ``El = E // W`` local experts,
expert ``e`` lives on rank ``e // El`` as its local expert ``e % El``):

- a *copy* is one (token ``t``, choice ``k``) pair of a source rank, with flat
  id ``j = t * K + k``;
- ``counts_all[s, e]`` is how many copies source rank ``s`` routes to expert
  ``e`` (every rank sees the same ``(W, E)`` table after the exchange);
- each rank's *receive buffer* is expert-major: its local experts in order,
  and inside one expert the rows ordered by (source rank, source token, k).

From ``counts_all`` alone, prefix sums give every copy its slot:

    slot(s, t, k) = expert_base[e] + src_prefix[s, e] + within(s, t, k)

where ``expert_base[e]`` is where expert ``e`` starts in its owner's buffer,
``src_prefix[s, e]`` counts the copies of lower source ranks for ``e``, and
``within`` is the copy's rank among source ``s``'s copies for ``e`` in flat-id
order. No function here synchronises with the host unless a caller asks for a
Python number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "RouteLayout",
    "TileLayout",
    "count_per_expert",
    "compute_layout",
    "compute_tiles",
    "slot_capacity",
    "tile_capacity",
    "token_destinations",
    "token_row",
]


def count_per_expert(selected_experts_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Copies per global expert, ``(E,) int64``, from ``(T, K)`` expert ids.

    ``bincount`` rather than TorchTitan's ``histc``: exact integers on every
    device (``histc`` has no int64 CPU kernel) and deterministic.
    """
    return torch.bincount(selected_experts_indices.reshape(-1), minlength=num_experts).to(torch.int64)


@dataclass(frozen=True)
class RouteLayout:
    """Where this rank's copies go, and where the rows it receives sit.

    Source side (this rank's ``T`` tokens, ``N = T * K`` copies):

    - ``dest_rank`` ``(T, K) int64``: EP rank that owns the copy's expert.
    - ``dest_slot`` ``(T, K) int64``: row of the copy in ``dest_rank``'s receive
      buffer.
    - ``send_order`` ``(N,) int64``: flat copy ids sorted by (destination rank,
      local expert, t, k); the order in which a collective sends them, and the
      order in which combined rows come back.
    - ``send_counts`` ``(W,) int64``: copies sent to each rank.

    Receive side (rows other ranks' copies put on this rank):

    - ``recv_counts`` ``(W,) int64``: rows received from each source rank.
    - ``expert_offsets`` ``(El + 1,) int64``: start of each local expert's rows
      in the receive buffer; ``expert_offsets[-1]`` is the number of rows.
    - ``tokens_per_local_expert`` ``(El,) int64``.
    - ``counts_all`` ``(W, E) int64``: the exchanged table it was built from.

    ``stream_slots(R)`` maps a source-major stream of received rows (all of
    rank 0's rows for this rank in its send order, then rank 1's, ...: what
    ``all_to_all_single`` delivers) to receive-buffer slots.
    """

    num_experts: int
    ep_size: int
    rank: int
    top_k: int
    dest_rank: torch.Tensor
    dest_slot: torch.Tensor
    send_order: torch.Tensor
    send_counts: torch.Tensor
    recv_counts: torch.Tensor
    expert_offsets: torch.Tensor
    tokens_per_local_expert: torch.Tensor
    counts_all: torch.Tensor

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def stream_slots(self, recv_rows: int) -> torch.Tensor:
        """``(R,) int64`` slot of each row of the source-major receive stream.

        ``recv_rows`` (R) is ``expert_offsets[-1]`` as a Python int; the
        caller passes it because it already synced to size the collective.
        """
        num_local, rank = self.num_local_experts, self.rank
        mine = slice(rank * num_local, (rank + 1) * num_local)
        recv_from = self.counts_all[:, mine]  # (W, El)
        src_prefix = _exclusive_cumsum(self.counts_all, 0)[:, mine]  # (W, El)
        # Blocks (s, el) in stream order; a block starts at stream position
        # block_start and lands at block_slot, its rows keeping their order.
        block_sizes = recv_from.reshape(-1)
        block_start = _exclusive_cumsum(block_sizes, 0)
        block_slot = (self.expert_offsets[:-1].unsqueeze(0) + src_prefix).reshape(-1)
        shift = torch.repeat_interleave(block_slot - block_start, block_sizes, output_size=recv_rows)
        return torch.arange(recv_rows, device=shift.device, dtype=torch.int64) + shift


def _exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(x, dim=dim) - x


def compute_layout(
    selected_experts_indices: torch.Tensor,
    counts_all: torch.Tensor,
    rank: int,
) -> RouteLayout:
    """Compute the deterministic layout of one MoE layer's exchange.

    Args:
        selected_experts_indices: ``(T, K)`` integer expert ids of this rank's
            tokens, each in ``[0, E)``. ``T`` may be 0.
        counts_all: ``(W, E) int64``, ``counts_all[s, e]`` = copies source
            rank ``s`` routes to expert ``e``; identical on every rank.
            ``counts_all[rank]`` must equal ``count_per_expert`` of
            ``selected_experts_indices``.
        rank: this rank's index in the EP group.

    Returns:
        RouteLayout (see its docstring).
    """
    if selected_experts_indices.dim() != 2:
        raise ValueError(
            f"selected_experts_indices must be (T, K), got shape {tuple(selected_experts_indices.shape)}"
        )
    ep_size, num_experts = counts_all.shape
    if num_experts % ep_size != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the EP size ({ep_size})"
        )
    if not 0 <= rank < ep_size:
        raise ValueError(f"rank {rank} outside the EP group of size {ep_size}")
    num_local = num_experts // ep_size
    device = selected_experts_indices.device
    counts_all = counts_all.to(device=device, dtype=torch.int64)
    num_tokens, top_k = selected_experts_indices.shape

    # ---- source side ----
    flat_expert = selected_experts_indices.reshape(-1).to(torch.int64)
    num_copies = flat_expert.numel()
    # Stable sort: inside one expert, copies stay in flat-id order (t, then k).
    send_order = torch.argsort(flat_expert, stable=True)
    sorted_expert = flat_expert[send_order]
    my_expert_start = _exclusive_cumsum(counts_all[rank], 0)
    within_sorted = torch.arange(num_copies, device=device, dtype=torch.int64) - my_expert_start[sorted_expert]
    within = torch.empty_like(within_sorted)
    within[send_order] = within_sorted

    src_prefix = _exclusive_cumsum(counts_all, 0)  # (W, E)
    rows_per_expert = counts_all.sum(0).view(ep_size, num_local)  # (W, El), by owner rank
    expert_base = _exclusive_cumsum(rows_per_expert, 1).reshape(num_experts)  # (E,)

    dest_slot = expert_base[flat_expert] + src_prefix[rank][flat_expert] + within
    dest_rank = torch.div(flat_expert, num_local, rounding_mode="floor")
    send_counts = counts_all[rank].view(ep_size, num_local).sum(1)

    # ---- receive side ----
    recv_counts = counts_all[:, rank * num_local : (rank + 1) * num_local].sum(1)
    tokens_per_local_expert = rows_per_expert[rank]
    expert_offsets = torch.cat(
        [torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(tokens_per_local_expert, 0)]
    )

    return RouteLayout(
        num_experts=num_experts,
        ep_size=ep_size,
        rank=rank,
        top_k=top_k,
        dest_rank=dest_rank.view(num_tokens, top_k),
        dest_slot=dest_slot.view(num_tokens, top_k),
        send_order=send_order,
        send_counts=send_counts,
        recv_counts=recv_counts,
        expert_offsets=expert_offsets,
        tokens_per_local_expert=tokens_per_local_expert,
        counts_all=counts_all,
    )


# ---------------------------------------------------------------------------
# Receive-buffer tiles and de-duplicated token rows (used by the Triton path).
#
# Both are pure functions of the layout above: they say which GEMM tile holds a
# slot and where the one copy of a token sits on a destination rank; they never
# move a slot.
# ---------------------------------------------------------------------------


def slot_capacity(ep_size: int, token_capacity: int, top_k: int, num_local_experts: int) -> int:
    """Most receive-buffer slots one rank can need: ``W * T * min(K, El)``.

    A token names ``K`` distinct experts (TorchTitan's top-k), so at most
    ``min(K, El)`` of them live on one rank.
    """
    return ep_size * token_capacity * min(top_k, num_local_experts)


def tile_capacity(num_slots: int, num_local_experts: int, block_m: int) -> int:
    """Most row tiles of ``block_m`` slots a receive buffer of ``num_slots``
    can split into: every local expert adds at most one partial tile."""
    return -(-num_slots // block_m) + num_local_experts


def token_row(source_rank: int, token: int, token_capacity: int) -> int:
    """Row of source ``source_rank``'s token ``token`` in a destination rank's
    de-duplicated token buffer: ``source_rank * token_capacity + token``.

    A token routed to several experts of one rank crosses the link once, into
    this row; every slot of those experts refers to it by index. Fixed per
    source (no prefix sum), so a sender needs nothing from the receiver.
    """
    return source_rank * token_capacity + token


def token_destinations(layout: RouteLayout) -> torch.Tensor:
    """``(T, W) bool``: whether token ``t`` has at least one copy on rank ``r``
    (then exactly one token row goes there, see ``token_row``)."""
    num_tokens = layout.dest_rank.shape[0]
    out = torch.zeros(num_tokens, layout.ep_size, dtype=torch.bool, device=layout.dest_rank.device)
    return out.scatter_(1, layout.dest_rank, True)


@dataclass(frozen=True)
class TileLayout:
    """GEMM row tiles of the expert-major receive buffers.

    Every rank's receive buffer is cut, expert by expert, into tiles of at
    most ``block_m`` slots; tile ids count up through the local experts in
    order. ``tile_capacity`` bounds the count so arrays have a fixed size (no
    host sync); entries past ``num_tiles`` are unused (start = end = 0).

    - ``tile_expert`` ``(C,) int32``: local expert of each of this rank's tiles.
    - ``tile_start`` / ``tile_end`` ``(C,) int32``: its slots ``[start, end)``.
    - ``num_tiles`` ``(1,) int32``: tiles in use on this rank.
    - ``dest_tile`` ``(T, K) int32``: tile on ``dest_rank`` that holds each of
      this rank's copies (so a sender can tell the tile its row arrived).
    """

    block_m: int
    tile_expert: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    num_tiles: torch.Tensor
    dest_tile: torch.Tensor


def compute_tiles(
    layout: RouteLayout,
    selected_experts_indices: torch.Tensor,
    block_m: int,
    tile_capacity: int,
) -> TileLayout:
    """Cut every rank's receive buffer into row tiles (device ops only).

    Args:
        layout: this rank's ``compute_layout`` result.
        selected_experts_indices: ``(T, K)`` expert ids it was built from.
        block_m: rows per tile.
        tile_capacity: length of the per-rank tile arrays (``tile_capacity()``).
    """
    ep_size, num_local = layout.ep_size, layout.num_local_experts
    device = layout.counts_all.device
    rows = layout.counts_all.sum(0).view(ep_size, num_local)  # (W, El) slots per (owner, expert)
    tiles = torch.div(rows + (block_m - 1), block_m, rounding_mode="floor")
    tile_base = _exclusive_cumsum(tiles, 1)  # (W, El)
    slot_base = _exclusive_cumsum(rows, 1)  # (W, El) == expert_offsets of each owner

    experts = selected_experts_indices.to(device=device, dtype=torch.int64)
    owner = torch.div(experts, num_local, rounding_mode="floor")
    local = experts - owner * num_local
    dest_tile = tile_base[owner, local] + torch.div(
        layout.dest_slot - slot_base[owner, local], block_m, rounding_mode="floor"
    )

    my_tiles, my_base = tiles[layout.rank], tile_base[layout.rank]
    tile_ids = torch.arange(tile_capacity, device=device, dtype=torch.int64)
    expert_of = torch.searchsorted(torch.cumsum(my_tiles, 0), tile_ids, right=True)
    used = expert_of < num_local
    expert = expert_of.clamp(max=num_local - 1)
    start = slot_base[layout.rank][expert] + (tile_ids - my_base[expert]) * block_m
    end = torch.minimum(start + block_m, slot_base[layout.rank][expert] + rows[layout.rank][expert])
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return TileLayout(
        block_m=block_m,
        tile_expert=torch.where(used, expert, zero).to(torch.int32),
        tile_start=torch.where(used, start, zero).to(torch.int32),
        tile_end=torch.where(used, end, zero).to(torch.int32),
        num_tiles=my_tiles.sum().view(1).to(torch.int32),
        dest_tile=dest_tile.to(torch.int32),
    )
