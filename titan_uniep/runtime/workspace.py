"""The symmetric-memory workspaces of UniEP's kernels, forward and backward.

One object per EP group owns every buffer the kernels exchange through:
allocated once (never inside CUDA-graph capture), reused by every MoE layer
and every step, grown only by an explicit collective call.

Per rank, one *arena* (a symmetric allocation, so every peer can address it)
holds, for a token capacity ``T`` (tokens per rank), dim ``D``, ``K`` experts
per token, ``E`` experts, EP size ``W``, ``El = E / W`` local experts, slot
capacity ``S = W * T * min(K, El)`` and tile capacity
``C = ceil(S / block_m) + El``, with ``b`` bytes per activation element:

=================  =================  =====================================
buffer             bytes              written by
=================  =================  =====================================
tokens             W * T * D * b      dispatch (de-duplicated token rows;
                                      0 at W = 1: the tiles read x in place)
slot_copy          4 * S              dispatch (slot -> copy id)
slot_score         4 * S              dispatch (router score of the slot)
tile_arrivals      4 * C              dispatch (release), fc1 waits
returned           T * K * R * b      fc2 (expert output of each copy;
                                      R = D, or ``returned_row``)
token_arrivals     4 * T              fc2 (release), reduce waits
counts             2 * W * E * 8      counts exchange (two epochs' tables)
count_flags        2 * W * 8          counts exchange (epoch of each table)
abort              8 * ABORT_WORDS    the first failing rank (claim, abort
                                      word, its error record)
slot_stamps        4 * S              dispatch (race mode only, else 0)
row_stamps         4 * T * K *        combine (race mode only, else 0)
                   cdiv(D, 16)
=================  =================  =====================================

each rounded up to 256 bytes. Local (not symmetric) per rank: ``h``
``S * H * b`` (fc1 output), the exchanged ``counts_all`` ``W * E * 8``,
``CONTROL_WORDS * 8`` of control words (task counters, epoch, error
record), and the current call's layout arrays that ``kernels.route`` writes (int32: ``num_tokens``,
``block_counts`` ``(NB, E)`` with ``NB = ceil(T * K / route_block(E))``,
``route_tables`` ``(5, E)``, ``dest_rank``/``dest_slot``/``dest_tile``
``(T, K)``, ``tile_expert``/``tile_start``/``tile_end``/``tile_order``
``(C,)``, ``num_tiles``). ``memory_bytes()`` returns exactly these numbers.

Flags are never reset by a memset-and-barrier: each call's exchange bumps a
per-rank epoch, publishes its counts tagged with it, and zeroes this rank's
own arrival counters before releasing them (see ``kernels.scoreboard``).

Three ways to build one:

- ``Workspace.for_group(group, ...)``: real EP, one process per GPU, arenas
  from ``torch.distributed._symmetric_memory`` (CUDA backend). Every rank
  must build the same shape (the kernels index a peer's arena with their
  own offsets): ``agree_on_shape`` takes the group's largest token capacity
  and refuses any other difference, before anything is allocated.
- ``Workspace.ranks_in_process(world_size, ...)``: real-rank mode on one
  device, one workspace per rank, each with its own arena (a separate
  allocation), route arrays and control words, as ``for_group`` builds them
  on W GPUs; each rank's calls launch exactly the binaries a real rank
  launches (one rank per launch, system scope). Testing and stress runs
  (``titan_uniep.tools.real_ranks``).
- ``Workspace.simulated(world_size, ...)``: every rank's buffers in this
  process (CPU interpreter or one GPU); the "peer pointers" are the other
  ranks' tensors. One launch runs the whole world.

Error checks: a kernel that times out leaves a record in the control words
and stops every rank through the abort words (``kernels.scoreboard``): each
rank's error names the rank, task and counter that failed first.
``check_errors()`` reads both (a device-to-host sync). ``poll_errors()`` does
not sync: it inspects the copies that ``schedule_error_poll()`` queued on the
stream after earlier calls, oldest first, once each has landed (a ring of
pinned copies: a later call never discards an earlier copy still in flight,
so a failure surfaces at the first MoE call after the failed call's kernels
have finished); ``wait_errors()`` waits for the queued copies first. The
fused path polls at entry and queues a copy at exit; the trainer's per-step
check (``titan_uniep.op.end_step``) has the next step's first MoE call wait
for every workspace's copies. After a failure the workspace is unusable (ranks' epochs
and counters disagree; its abort word stays set): raise, and rebuild it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels.route import MAX_EXPERTS, ROUTE_TABLE_ROWS, num_route_blocks
from ..kernels.scoreboard import (
    ABORT_FIELDS,
    ABORT_WORDS,
    BAD_SLOT,
    CONTROL_WORDS,
    CTL_EPOCH,
    CTL_ERROR,
    CTL_RACE,
    ERROR_FIELDS,
    FAILED,
    RACE_FIELDS,
    RACE_KEEP_ONE,
    STOPPED,
    WAIT_COUNTS_FLAG,
    WAIT_TILE_ROWS,
    WAIT_TOKEN_ROWS,
    Arena,
    Route,
)
from ..layout import slot_capacity, tile_capacity
from ..params import LayerParams, default_params

__all__ = ["BackwardWorkspace", "Workspace", "WorkspaceShape", "agree_on_shape", "backward_returned_row", "memory_bytes"]

_ALIGN = 256
# Element type of each arena buffer (None: the activation dtype).
ARENA_DTYPES = {
    "tokens": None, "slot_copy": torch.int32, "slot_score": torch.float32, "tile_arrivals": torch.int32,
    "returned": None, "token_arrivals": torch.int32, "counts": torch.int64, "count_flags": torch.int64,
    "abort": torch.int64, "slot_stamps": torch.int32, "row_stamps": torch.int32,
}
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class WorkspaceShape:
    """What the buffers are sized for. ``token_capacity``: most tokens any rank
    routes in one call (batch x sequence on that rank)."""

    world_size: int
    token_capacity: int
    dim: int
    hidden: int
    num_experts: int
    top_k: int
    dtype: torch.dtype
    block_m: int
    race_stamps: bool = False  # the arrival stamps of race mode (LayerParams.debug_race, testing only)
    returned_row: int = 0  # elements per returned row (0: dim); the backward's: backward_returned_row

    @property
    def returned_row_elems(self) -> int:
        return self.returned_row or self.dim

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def slot_capacity(self) -> int:
        return slot_capacity(self.world_size, self.token_capacity, self.top_k, self.num_local_experts)

    @property
    def tile_capacity(self) -> int:
        return tile_capacity(self.slot_capacity, self.num_local_experts, self.block_m)

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def arena_sizes(self) -> dict[str, int]:
        w, t, d, k, e, b = self.world_size, self.token_capacity, self.dim, self.top_k, self.num_experts, self.elem_size
        s, c = self.slot_capacity, self.tile_capacity
        return {
            "tokens": w * t * d * b if w > 1 else 0,  # one rank: x read in place (scoreboard.token_rows_of)
            "slot_copy": 4 * s,
            "slot_score": 4 * s,
            "tile_arrivals": 4 * c,
            "returned": t * k * self.returned_row_elems * b,
            "token_arrivals": 4 * t,
            "counts": 2 * w * e * 8,
            "count_flags": 2 * w * 8,
            "abort": 8 * ABORT_WORDS,
            # Race mode only: a slot's and a returned row's (per 16 columns) arrival stamp.
            "slot_stamps": 4 * s if self.race_stamps else 0,
            "row_stamps": 4 * t * k * -(-d // 16) if self.race_stamps else 0,
        }

    def arena_offsets(self) -> tuple[dict[str, int], int]:
        """Byte offset of each buffer in the arena, and the arena's size."""
        offsets, end = {}, 0
        for name, size in self.arena_sizes().items():
            offsets[name] = end
            end += _round_up(max(size, 1), _ALIGN)
        return offsets, end


def memory_bytes(shape: WorkspaceShape) -> dict[str, int]:
    """Bytes per rank, by buffer (see the module docstring for the formulas).
    Keys: the arena buffers, ``"arena"`` (their padded total, symmetric),
    ``"h"``, ``"counts_all"``, ``"control"``, ``"route"`` (local: the
    layout arrays of ``kernels.route``) and ``"total"``."""
    sizes = dict(shape.arena_sizes())
    sizes["arena"] = shape.arena_offsets()[1]
    sizes["h"] = shape.slot_capacity * shape.hidden * shape.elem_size
    sizes["counts_all"] = shape.world_size * shape.num_experts * 8
    sizes["control"] = CONTROL_WORDS * 8
    t, k, e, c = shape.token_capacity, shape.top_k, shape.num_experts, shape.tile_capacity
    sizes["route"] = 4 * (1 + max(1, num_route_blocks(t, k, e)) * e + ROUTE_TABLE_ROWS * e + 3 * t * k + 4 * c + 1)
    sizes["total"] = sizes["arena"] + sizes["h"] + sizes["counts_all"] + sizes["control"] + sizes["route"]
    return sizes


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def agree_on_shape(shape: WorkspaceShape, params: LayerParams, group: dist.ProcessGroup) -> WorkspaceShape:
    """The shape every rank of ``group`` builds: the group's largest token
    capacity, every other field (and every ``LayerParams`` field, which sets
    the tiles and the arrivals a peer waits for) the same on every rank, else
    a ValueError naming what differs on which ranks. Collective (a host
    sync): call it where the workspace is built, outside the step."""
    mine = {**shape.__dict__, "dtype": str(shape.dtype), "params": params}
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    differ = []
    for name, value in mine.items():
        if name == "token_capacity":
            continue
        seen = [rank_fields[name] for rank_fields in every]
        if any(v != value for v in seen):
            if name == "params":
                fields = [f for f in params.__dataclass_fields__ if len({getattr(p, f) for p in seen}) > 1]
                seen = [{f: getattr(p, f) for f in fields} for p in seen]
            differ.append(f"{name}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(seen)))
    if differ:
        raise ValueError(
            "UniEP workspaces must have the same shape and parameters on every EP rank (a kernel addresses its "
            "peers' buffers with its own offsets and waits for as many arrivals as its own tiles send), but "
            + "; ".join(differ) + ". Build every rank's layer with the same dim, hidden dim, experts, top-k, dtype "
            "and [uniep] settings (tuning cache included).")
    most = max(rank_fields["token_capacity"] for rank_fields in every)
    return WorkspaceShape(**{**shape.__dict__, "token_capacity": most})


_FORWARD_WAITS = {
    WAIT_COUNTS_FLAG: "the counts exchange, waiting for rank {index}'s per-expert counts (count_flags[{index}])",
    WAIT_TILE_ROWS: "dispatch_fc1 (fc1 tile), waiting for the dispatched rows of tile {index} (tile_arrivals[{index}])",
    WAIT_TOKEN_ROWS: "fc2_combine (reduce), waiting for token {index}'s expert outputs (token_arrivals[{index}])",
    BAD_SLOT: "dispatch_fc1 (dispatch): token {index} has a copy whose slot is outside the receive buffer "
    "(a token routed to the same expert twice, or a corrupted counts table)",
}
_BACKWARD_WAITS = {
    WAIT_COUNTS_FLAG: "the backward counts exchange, waiting for rank {index}'s counts (count_flags[{index}])",
    WAIT_TILE_ROWS: "dispatch_dh (dH tile), waiting for the dispatched [x | dOut] rows of tile {index}",
    WAIT_TOKEN_ROWS: "da_combine (reduce), waiting for token {index}'s dA rows (token_arrivals[{index}])",
    BAD_SLOT: "dispatch_dh (dispatch): token {index} has a copy whose slot is outside the receive buffer",
}


class Workspace:
    """Buffers of one EP group (see the module docstring). Build with
    ``for_group`` or ``simulated``; never inside CUDA-graph capture."""

    def __init__(self, *, shape: WorkspaceShape, rank_base: int, num_local_ranks: int, device: torch.device,
                 params: LayerParams, group: dist.ProcessGroup | None,
                 peer_arenas: list[torch.Tensor] | None = None):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("UniEP Workspace must be built before CUDA-graph capture, not inside it")
        if shape.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"UniEP kernels support activations in {SUPPORTED_DTYPES}, got {shape.dtype}")
        if shape.num_experts % shape.world_size:
            raise ValueError(f"num_experts ({shape.num_experts}) must be divisible by the EP size ({shape.world_size})")
        if shape.num_experts > MAX_EXPERTS:
            raise ValueError(f"UniEP kernels support at most {MAX_EXPERTS} experts, got {shape.num_experts}")
        if params.block_m != shape.block_m:
            raise ValueError(f"shape.block_m ({shape.block_m}) must equal params.block_m ({params.block_m})")
        self.shape = shape
        self.rank_base = rank_base
        self.num_local_ranks = num_local_ranks
        self.device = device
        self.params = params
        self.group = group
        self.peer_arenas = peer_arenas  # ranks_in_process: every rank's arena, this rank's at [rank_base]
        # Which pass's kernels use it and what their waits mean (error messages).
        self.error_context: tuple[str, dict[int, str]] = ("forward", _FORWARD_WAITS)
        self._allocate()

    # ---- construction -------------------------------------------------

    @classmethod
    def for_group(cls, group: dist.ProcessGroup, *, num_tokens: int, dim: int, hidden: int, num_experts: int,
                  top_k: int, dtype: torch.dtype, device: torch.device | int | None = None,
                  params: LayerParams | None = None, returned_row: int = 0) -> "Workspace":
        """Real EP: collective over ``group`` (every rank calls it with the same
        arguments). ``num_tokens``: the token capacity per rank. ``params``:
        the default of every call on it (``params.default_params`` of the EP
        size and shape if None); its ``block_m`` sizes the tile buffers.
        ``returned_row``: elements per returned row (0: ``dim``)."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device("cuda", device) if isinstance(device, int) else device
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"UniEP real EP needs an explicit CUDA device (cuda:N), got {device}")
        world_size = dist.get_world_size(group)
        params = params or default_params(world_size, hidden=hidden)
        shape = WorkspaceShape(world_size, num_tokens, dim, hidden, num_experts, top_k, dtype, params.block_m,
                               params.debug_race, returned_row)
        shape = agree_on_shape(shape, params, group)
        return cls(shape=shape, rank_base=dist.get_rank(group), num_local_ranks=1, device=device, params=params,
                   group=group)

    @classmethod
    def ranks_in_process(cls, world_size: int, *, num_tokens: int, dim: int, hidden: int, num_experts: int,
                         top_k: int, dtype: torch.dtype, device: torch.device | str,
                         params: LayerParams | None = None, returned_row: int = 0,
                         seed: int = 0) -> list["Workspace"]:
        """Real-rank mode on one device: one workspace per EP rank, as
        ``for_group`` builds them on ``world_size`` GPUs, in this process.
        Each rank has its own arena, a separate allocation, made in an order
        shuffled by ``seed`` (whatever the order, a peer's arena lies below
        some rank's own: the kernels' peer offsets are negative too), its own route
        arrays and control words, and the table of every rank's arena
        address; a call on one launches one rank (``NUM_LOCAL`` 1) at system
        scope, exactly the binaries a rank of a real group launches. Run each
        rank's calls on a stream of its own, with grids that let every
        rank's programs be resident together (``LayerParams.num_programs``:
        the SMs over ``world_size``). The workspaces cannot grow."""
        params = params or default_params(world_size, hidden=hidden)
        device = torch.device(device)
        shape = WorkspaceShape(world_size, num_tokens, dim, hidden, num_experts, top_k, dtype, params.block_m,
                               params.debug_race, returned_row)
        _, nbytes = shape.arena_offsets()
        raws: list[torch.Tensor | None] = [None] * world_size
        for rank in torch.randperm(world_size, generator=torch.Generator().manual_seed(seed)).tolist():
            raws[rank] = torch.zeros(nbytes + _ALIGN, dtype=torch.uint8, device=device)
        arenas = [raw[-raw.data_ptr() % _ALIGN:][:nbytes] for raw in raws]
        return [cls(shape=shape, rank_base=rank, num_local_ranks=1, device=device, params=params, group=None,
                    peer_arenas=arenas) for rank in range(world_size)]

    @classmethod
    def simulated(cls, world_size: int, *, num_tokens: int, dim: int, hidden: int, num_experts: int, top_k: int,
                  dtype: torch.dtype, device: torch.device | str = "cpu",
                  params: LayerParams | None = None, returned_row: int = 0) -> "Workspace":
        """All ``world_size`` ranks' buffers in this process (one launch runs
        the whole world); ``params`` and ``returned_row`` as ``for_group``."""
        params = params or default_params(world_size, hidden=hidden)
        shape = WorkspaceShape(world_size, num_tokens, dim, hidden, num_experts, top_k, dtype, params.block_m,
                               params.debug_race, returned_row)
        return cls(shape=shape, rank_base=0, num_local_ranks=world_size, device=torch.device(device),
                   params=params, group=None)

    def _allocate(self) -> None:
        shape, n, dev = self.shape, self.num_local_ranks, self.device
        self.offsets, self.arena_bytes = shape.arena_offsets()
        if self.group is not None:
            import torch.distributed._symmetric_memory as symm_mem

            self.arena = symm_mem.empty(self.arena_bytes, dtype=torch.uint8, device=dev)
            self.arena.zero_()
            self.handle = symm_mem.rendezvous(self.arena, self.group)
            if any(ptr % _ALIGN for ptr in self.handle.buffer_ptrs):
                raise RuntimeError(f"symmetric buffers are not {_ALIGN}-byte aligned: {self.handle.buffer_ptrs}")
            self.arena_ptrs = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=dev)
            # Every arena is zeroed (flags below the first epoch) before any peer writes.
            torch.cuda.synchronize(dev)
            dist.barrier(group=self.group, device_ids=[dev.index])
        elif self.peer_arenas is not None:
            self.handle = None
            self.arena = self.peer_arenas[self.rank_base]
            self.arena_ptrs = torch.tensor([a.data_ptr() for a in self.peer_arenas], dtype=torch.int64, device=dev)
        else:
            self.handle = None
            # Kernels round arena bases down to 256 bytes (alignment hint): align them.
            raw = torch.zeros(shape.world_size * self.arena_bytes + _ALIGN, dtype=torch.uint8, device=dev)
            skip = -raw.data_ptr() % _ALIGN
            self.arena = raw[skip:skip + shape.world_size * self.arena_bytes].view(shape.world_size, self.arena_bytes)
            self.arena_ptrs = torch.tensor(
                [self.arena[r].data_ptr() for r in range(shape.world_size)], dtype=torch.int64, device=dev
            )
        # Kernels address every arena as typed pointer anchor + delta (see kernels.scoreboard.arena_ptr):
        # the anchor is this rank's arena (real EP) or rank 0's (simulated world).
        self.anchor_rank = self.rank_base
        anchor = self.arena if not self.is_simulated else self.arena[0]
        self.anchors = {dt: anchor.view(dt) for dt in {shape.dtype, torch.int32, torch.float32, torch.int64}}
        self.element_offsets = {
            name: self.offsets[name] // torch.empty((), dtype=dt or shape.dtype).element_size()
            for name, dt in ARENA_DTYPES.items()
        }
        self.h = torch.empty(n, shape.slot_capacity, shape.hidden, dtype=shape.dtype, device=dev)
        self.counts_all = torch.zeros(n, shape.world_size, shape.num_experts, dtype=torch.int64, device=dev)
        # The layout of the current call, written by the route kernels (kernels.route), read by the megakernels.
        t, k, e, c = shape.token_capacity, shape.top_k, shape.num_experts, shape.tile_capacity
        self.num_tokens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_counts = torch.zeros(n, max(1, num_route_blocks(t, k, e)), e, dtype=torch.int32, device=dev)
        self.route_tables = torch.zeros(n, ROUTE_TABLE_ROWS, e, dtype=torch.int32, device=dev)
        self.dest_rank = torch.zeros(n, t, k, dtype=torch.int32, device=dev)
        self.dest_slot = torch.zeros(n, t, k, dtype=torch.int32, device=dev)
        self.dest_tile = torch.zeros(n, t, k, dtype=torch.int32, device=dev)
        self.tile_expert = torch.zeros(n, c, dtype=torch.int32, device=dev)
        self.tile_start = torch.zeros(n, c, dtype=torch.int32, device=dev)
        self.tile_end = torch.zeros(n, c, dtype=torch.int32, device=dev)
        self.num_tiles = torch.zeros(n, dtype=torch.int32, device=dev)
        self.tile_order = torch.zeros(n, c, dtype=torch.int32, device=dev)  # own-rows tiles first (local_first)
        self.control = torch.zeros(n, CONTROL_WORDS, dtype=torch.int64, device=dev)
        off = self.element_offsets
        # The packed kernel arguments (kernels.scoreboard).
        self.arena_args = Arena(
            self.arena_ptrs, self.anchors[shape.dtype], self.anchors[torch.int32], self.anchors[torch.float32],
            self.anchors[torch.int64], off["tokens"], off["slot_copy"], off["slot_score"], off["tile_arrivals"],
            off["returned"], self.offsets["returned"] // 4, off["token_arrivals"], off["counts"],
            off["count_flags"], off["abort"],
            off["slot_stamps"], off["row_stamps"], shape.token_capacity, shape.slot_capacity, shape.tile_capacity,
        )
        self.route_args = Route(
            self.dest_rank, self.dest_slot, self.dest_tile, self.dest_rank.stride(0), self.num_tokens,
            self.tile_expert, self.tile_start, self.tile_end, self.tile_order, self.tile_expert.stride(0),
            self.num_tiles, self.route_tables,
        )
        start = self.offsets["abort"]
        self.abort_words = self.arena[..., start:start + 8 * ABORT_WORDS].view(torch.int64).view(n, ABORT_WORDS)
        self._error_copies = ErrorCopies(n, dev)
        self._failure: str | None = None  # the message of a failure seen, raised again by every later check

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    @property
    def is_simulated(self) -> bool:
        """Whether one launch runs every rank of the world (``simulated``)."""
        return self.group is None and self.peer_arenas is None

    @property
    def rank(self) -> int:
        """This process's EP rank (real EP only)."""
        if self.is_simulated:
            raise AttributeError("a simulated workspace holds every rank")
        return self.rank_base

    def memory_bytes(self) -> dict[str, int]:
        """Bytes per rank by buffer (``memory_bytes(self.shape)``)."""
        return memory_bytes(self.shape)

    @property
    def symmetric_bytes(self) -> int:
        """Bytes this process holds in symmetric memory: the arena of a real
        EP workspace (0 simulated). PyTorch's symmetric-memory allocator maps
        them itself, outside its caching allocator, so
        ``torch.cuda.memory_reserved`` and TorchTitan's memory figure leave
        them out."""
        return self.arena.numel() if self.handle is not None else 0

    def returned_region(self) -> torch.Tensor | None:
        """The ``returned`` buffer of this process's one rank, as bytes (None
        where the workspace holds several ranks). Between two calls on it
        nothing in it is live: each call's fc2 writes the rows its reduce
        reads, and only peers' fc2 of a later call, after this rank has
        dispatched that call's tokens, write it again."""
        if self.num_local_ranks != 1:
            return None
        start = self.offsets["returned"]
        return self.arena.view(-1)[start:start + self.shape.arena_sizes()["returned"]]

    def arena_view(self, local: int, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """This process's view of one arena buffer of local rank ``local`` (tests, poisoning)."""
        arena = self.arena if not self.is_simulated else self.arena[local]
        start = self.offsets[name]
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return arena[start:start + nbytes].view(dtype).view(shape)

    def poison(self) -> None:
        """Fill every data buffer with NaN (tests: a row that is read before it
        is written shows up). Counters and flags are left alone."""
        s = self.shape
        for local in range(self.num_local_ranks):
            if s.world_size > 1:
                self.arena_view(local, "tokens", s.dtype, (s.world_size * s.token_capacity, s.dim)).fill_(
                    float("nan"))
            self.arena_view(local, "returned", s.dtype, (s.token_capacity * s.top_k, s.returned_row_elems)).fill_(
                float("nan"))
            self.arena_view(local, "slot_score", torch.float32, (s.slot_capacity,)).fill_(float("nan"))
        self.h.fill_(float("nan"))

    def ensure_capacity(self, num_tokens: int) -> bool:
        """Grow the buffers so every rank can route ``num_tokens`` tokens per
        call. Collective in real EP (all ranks call it; the largest request
        wins) and it synchronises with the host: call it outside the training
        step and outside CUDA-graph capture. Returns whether it grew."""
        if self.group is not None:
            wanted = torch.tensor([num_tokens], dtype=torch.int64, device=self.device)
            dist.all_reduce(wanted, op=dist.ReduceOp.MAX, group=self.group)
            num_tokens = int(wanted.item())
        if num_tokens <= self.shape.token_capacity:
            return False
        if self.peer_arenas is not None:
            raise ValueError("workspaces of ranks_in_process cannot grow one rank at a time: build them again with "
                             f"num_tokens={num_tokens}")
        self.check_errors()
        epochs = self.control[:, CTL_EPOCH].clone()
        self.shape = WorkspaceShape(**{**self.shape.__dict__, "token_capacity": num_tokens})
        self._allocate()
        self.control[:, CTL_EPOCH] = epochs
        return True

    # ---- errors ---------------------------------------------------------

    def _raise_from(self, control: torch.Tensor, aborts: torch.Tensor) -> None:
        """Raise the failure that copies of the control words and abort words
        ``(L, ...)`` show, if any (and remember it)."""
        if self._failure is None:
            self._failure = self._failure_message(control[:, CTL_ERROR:CTL_ERROR + len(ERROR_FIELDS)], aborts)
        if self._failure is not None:
            raise RuntimeError(self._failure)

    def _failure_message(self, records: torch.Tensor, aborts: torch.Tensor) -> str | None:
        role, descriptions = self.error_context
        timeout = (f"{self.params.timeout_s:g} s" if self.device.type == "cuda"
                   else f"{self.params.interpreter_max_spins} polls")

        def failure(rec: dict) -> str:
            text = descriptions.get(rec["what"], "an unknown wait ({what})").format(**rec)
            if rec["what"] == BAD_SLOT:
                return f"{text}; capacity {rec['expected']}, slot {rec['seen']}"
            return f"{text}; expected {rec['expected']}, saw {rec['seen']} after {timeout}"

        root, ranks = None, []
        for local in range(records.shape[0]):
            rec = dict(zip(ERROR_FIELDS, records[local].tolist()))
            abort = dict(zip(ABORT_FIELDS, aborts[local].tolist()))
            if abort["code"]:
                root = abort
            ranks.append((self.rank_base + local, rec))
        first = (f"EP rank {root['rank']} failed first (call epoch {root['epoch']}, task {root['task']}): "
                 f"{failure(root)}") if root is not None else None
        lines = []
        for rank, rec in ranks:
            where = f"EP rank {rank} (call epoch {rec['epoch']}, task {rec['task']})"
            if rec["flag"] == FAILED and root is None:  # (its abort words have not reached this rank)
                lines.append(f"UniEP {role} failed on {where}: {failure(rec)}.")
            elif rec["flag"] == FAILED and root["rank"] == rank:
                lines.insert(0, f"UniEP {role} failed on {where}: {failure(rec)}. It failed first: every other EP "
                                "rank stopped at its next wait.")
            elif rec["flag"] == FAILED:
                lines.append(f"UniEP {role} failed on {where}: {failure(rec)}; {first}.")
            elif rec["flag"] == STOPPED:
                text = descriptions.get(rec["what"], "an unknown wait ({what})").format(**rec)
                lines.append(f"UniEP {role} stopped on {where}, in {text} (saw {rec['seen']} of {rec['expected']}), "
                             f"because {first}.")
            elif root is not None:
                lines.append(f"UniEP {role} stopped on EP rank {rank} because {first}.")
        if not lines:
            return None
        return "\n".join(lines) + (
            "\nA peer rank did not reach this MoE layer or stopped sending (see the other ranks' errors). This "
            "workspace is unusable now; rebuild it (or raise LayerParams.timeout_s if a peer is merely slow).")

    def check_errors(self) -> None:
        """Raise RuntimeError if a kernel of this rank failed or was stopped by a
        failed peer (syncs with the device); the message names the rank, task
        and counter that failed first."""
        self._raise_from(self.control.cpu(), self.abort_words.cpu())

    def poll_errors(self) -> None:
        """Raise if an earlier queued copy of the error words (``schedule_error_poll``)
        has landed and shows a failure. Never waits for the device."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        if self._failure is not None:
            raise RuntimeError(self._failure)
        for control, aborts in self._error_copies.landed():
            self._raise_from(control, aborts)

    def wait_errors(self) -> None:
        """Wait for every queued copy of the error words (``schedule_error_poll``)
        to land and raise a failure any of them shows: the kernels queued
        before the last copy are then checked. Waits only for those copies,
        not for work queued after them."""
        self._error_copies.wait()
        self.poll_errors()

    def schedule_error_poll(self) -> None:
        """Queue a copy of the error words (control and abort words) to pinned host
        memory on the current stream (no sync); skipped during CUDA-graph capture."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        self._error_copies.push(self.control, self.abort_words)

    def start_race_report(self, params: LayerParams) -> None:
        """Race mode (``params.debug_race``, testing only): the seed and keep
        threshold of this call's producers, every count of the race report zeroed."""
        if not self.shape.race_stamps:
            raise ValueError("LayerParams.debug_race needs a workspace built with it (it allocates the arrival "
                             "stamps): pass params with debug_race=True when building the workspace")
        words = torch.zeros(len(RACE_FIELDS), dtype=torch.int64)
        words[0], words[1] = params.debug_race_seed, round(params.debug_race_keep * RACE_KEEP_ONE)
        self.control[:, CTL_RACE:CTL_RACE + len(RACE_FIELDS)] = words.to(self.device)

    def race_report(self) -> list[dict[str, int]]:
        """Race mode (testing only): per local rank, what the last call's
        tile-rows waits (fc1, dH tiles) and token-rows waits (reduce tasks)
        did: ``*_skipped`` (not ready at their one poll), ``*_passed`` (every
        row they read had arrived), ``*_violations`` (passed their wait, but a
        row they would read had not arrived: a race), and the first violation
        (``first_what``: ``WAIT_TILE_ROWS`` or ``WAIT_TOKEN_ROWS``, its task,
        tile or token and the slot or returned row missing)."""
        words = self.control[:, CTL_RACE:CTL_RACE + len(RACE_FIELDS)].cpu()
        return [dict(zip(RACE_FIELDS, row.tolist())) for row in words]


class ErrorCopies:
    """A ring of copies of a workspace's error words (control words, abort
    words), queued on the stream after calls and inspected once landed,
    oldest first. A new copy takes a free slot, or else the newest pending
    one (its copy is superseded by one queued after it), never an older one:
    while the host runs ahead of a kernel that spins for its timeout, the
    first copy queued after it still lands right after it. The error record
    is sticky, so any copy after a failure shows it. On CPU the copies are
    synchronous and land at once."""

    SLOTS = 4

    def __init__(self, num_local: int, device: torch.device):
        pinned = device.type == "cuda"
        self.control = [torch.zeros(num_local, CONTROL_WORDS, dtype=torch.int64, pin_memory=pinned)
                        for _ in range(self.SLOTS)]
        self.aborts = [torch.zeros(num_local, ABORT_WORDS, dtype=torch.int64, pin_memory=pinned)
                       for _ in range(self.SLOTS)]
        self.events = [torch.cuda.Event() if pinned else None for _ in range(self.SLOTS)]
        self.pending: deque[int] = deque()
        self.free = list(range(self.SLOTS))

    def push(self, control: torch.Tensor, aborts: torch.Tensor) -> None:
        slot = self.free.pop() if self.free else self.pending.pop()
        self.control[slot].copy_(control, non_blocking=True)
        self.aborts[slot].copy_(aborts, non_blocking=True)
        if self.events[slot] is not None:
            self.events[slot].record()
        self.pending.append(slot)

    def wait(self) -> None:
        """Wait until every pending copy has landed."""
        for slot in self.pending:
            if self.events[slot] is not None:
                self.events[slot].synchronize()

    def landed(self):
        """Yield (control, abort words) of every copy that has landed, oldest first."""
        while self.pending and (self.events[self.pending[0]] is None or self.events[self.pending[0]].query()):
            slot = self.pending.popleft()
            self.free.append(slot)
            yield self.control[slot], self.aborts[slot]


RETURNED_ROW_ALIGN = 128
"""Bytes a backward returned row is padded to: every row starts on a 128-byte
line, as the forward's ``D``-wide rows do for the shapes that train."""


def backward_returned_row(dim: int, dtype: torch.dtype) -> int:
    """Elements per returned row of the backward: the dA row (``dim``
    elements) and, after it, one fp32 word (the copy's router-score
    gradient), padded to ``RETURNED_ROW_ALIGN`` bytes."""
    elem = torch.empty((), dtype=dtype).element_size()
    if (dim * elem) % 4:
        raise ValueError(f"the backward needs dim * element size to be a multiple of 4 bytes, got {dim} x {elem}")
    return -(-(dim * elem + 4) // RETURNED_ROW_ALIGN) * RETURNED_ROW_ALIGN // elem


class BackwardWorkspace:
    """Buffers of the backward of one EP group, by composition: a ``Workspace``
    built for rows of ``2 * D`` (its ``tokens`` hold ``[x | dOut]`` rows; its
    ``returned`` rows, ``backward_returned_row`` elements each, hold dA and the
    fp32 router-score gradient; its route arrays hold the call's layout), plus local ``dh1``/``dh3`` ``(L, S, H)``
    next to its ``h``, the router-score partials ``ds_parts``
    ``(L, S, cdiv(H, dh))`` fp32 (``dh`` the dH tile width, ``LayerParams.dh_block_n``)
    ``slot_rows`` ``(L, 2, S, D)``: each slot's x and dOut rows in slot
    order, the weight gradients' dense operands, and ``g32`` ``(L, S, H)``
    fp32: the dH tiles' ``G = dOut @ w2``, which the SwiGLU pass reads.

    Memory per rank (``S = W * T * min(K, El)`` slots, ``b`` bytes per
    element): symmetric ``2 * W * T * D * b`` (token rows; none at W = 1) + ``T * K * R * b``
    (returned, ``R * b`` = ``D * b + 4`` rounded up to 128 bytes) + small index/flag buffers;
    local ``3 * S * H * b`` (``h``, ``dh1``, ``dh3``; ``titan_uniep.op`` gives it the
    forward workspace's ``h``, scratch within a call in both, and at W = 1 moves what fits
    of ``CALL_SCRATCH`` into the forward's returned rows: ``borrow_scratch``) +
    ``4 * S * cdiv(H, dh)`` + ``2 * S * D * b`` (slot rows) + ``4 * S * H``
    (``g32``) + the route arrays. Build it before CUDA-graph capture; reuse
    it for every layer and step.
    """

    def __init__(self, inner: Workspace, dim: int):
        self.inner = inner
        self.dim = dim
        inner.error_context = ("backward", _BACKWARD_WAITS)
        self._allocate_local()

    def _allocate_local(self) -> None:
        inner = self.inner
        self.dh1 = torch.empty_like(inner.h)
        self.dh3 = torch.empty_like(inner.h)
        parts = -(-inner.shape.hidden // inner.params.dh_block_n)
        self.ds_parts = torch.empty(inner.num_local_ranks, inner.shape.slot_capacity, parts, dtype=torch.float32,
                                    device=inner.device)
        self.slot_rows = torch.empty(inner.num_local_ranks, 2, inner.shape.slot_capacity, self.dim,
                                     dtype=inner.shape.dtype, device=inner.device)
        self.g32 = torch.empty(inner.h.shape, dtype=torch.float32, device=inner.device)

    CALL_SCRATCH = ("slot_rows", "g32", "dh1", "dh3")
    """The local buffers whose contents live within one backward call."""

    def borrow_scratch(self, region: torch.Tensor | None) -> int:
        """Move the ``CALL_SCRATCH`` buffers that fit into ``region`` (bytes
        nothing else holds while a backward call runs: the forward workspace's
        ``Workspace.returned_region``), largest first, each 256-byte aligned;
        their own tensors go back to the caching allocator. Returns the bytes
        moved. A world of one rank only (0 otherwise: see ``docs/design.md``).
        ``ensure_capacity`` reallocates them locally."""
        if region is None or self.inner.shape.world_size != 1:
            return 0
        used = moved = 0
        for name in sorted(self.CALL_SCRATCH, key=lambda n: -getattr(self, n).nbytes):
            buf = getattr(self, name)
            if used + buf.nbytes <= region.numel():
                setattr(self, name, region[used:used + buf.nbytes].view(buf.dtype).view(buf.shape))
                used, moved = _round_up(used + buf.nbytes, _ALIGN), moved + buf.nbytes
        return moved

    def ds_parts_for(self, col_blocks: int) -> torch.Tensor:
        """The score-partial buffer for dH tiles of ``col_blocks`` column blocks
        (reallocated when a call's tiles differ from the workspace config's)."""
        if self.ds_parts.shape[2] != col_blocks:
            if self.inner.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("BackwardWorkspace: call once outside CUDA-graph capture with these tiles first")
            self.ds_parts = self.ds_parts.new_empty(self.ds_parts.shape[0], self.ds_parts.shape[1], col_blocks)
        return self.ds_parts

    @classmethod
    def for_group(cls, group, *, num_tokens: int, dim: int, hidden: int, num_experts: int, top_k: int,
                  dtype: torch.dtype, device=None, params: LayerParams | None = None) -> "BackwardWorkspace":
        """Real EP: collective over ``group`` (same arguments on every rank)."""
        inner = Workspace.for_group(group, num_tokens=num_tokens, dim=2 * dim, hidden=hidden,
                                    returned_row=backward_returned_row(dim, dtype),
                                    num_experts=num_experts, top_k=top_k, dtype=dtype, device=device, params=params)
        return cls(inner, dim)

    @classmethod
    def ranks_in_process(cls, world_size: int, *, num_tokens: int, dim: int, hidden: int, num_experts: int,
                         top_k: int, dtype: torch.dtype, device, params: LayerParams | None = None,
                         seed: int = 0) -> list["BackwardWorkspace"]:
        """Real-rank mode on one device (``Workspace.ranks_in_process``): one per EP rank."""
        inners = Workspace.ranks_in_process(world_size, num_tokens=num_tokens, dim=2 * dim, hidden=hidden,
                                            returned_row=backward_returned_row(dim, dtype), num_experts=num_experts,
                                            top_k=top_k, dtype=dtype, device=device, params=params, seed=seed)
        return [cls(inner, dim) for inner in inners]

    @classmethod
    def simulated(cls, world_size: int, *, num_tokens: int, dim: int, hidden: int, num_experts: int, top_k: int,
                  dtype: torch.dtype, device="cpu", params: LayerParams | None = None) -> "BackwardWorkspace":
        """Every rank's buffers in this process (one launch runs the world)."""
        inner = Workspace.simulated(world_size, num_tokens=num_tokens, dim=2 * dim, hidden=hidden,
                                    returned_row=backward_returned_row(dim, dtype),
                                    num_experts=num_experts, top_k=top_k, dtype=dtype, device=device,
                                    params=params)
        return cls(inner, dim)

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def is_simulated(self) -> bool:
        return self.inner.is_simulated

    def memory_bytes(self) -> dict[str, int]:
        sizes = self.inner.memory_bytes()
        sizes["dh1"] = sizes["dh3"] = sizes["h"]
        sizes["ds_parts"] = self.ds_parts[0].numel() * 4
        sizes["slot_rows"] = self.slot_rows[0].numel() * self.slot_rows.element_size()
        sizes["g32"] = self.g32[0].numel() * 4
        sizes["total"] += 2 * sizes["h"] + sizes["ds_parts"] + sizes["slot_rows"] + sizes["g32"]
        return sizes

    @property
    def symmetric_bytes(self) -> int:
        """See ``Workspace.symmetric_bytes``."""
        return self.inner.symmetric_bytes

    def ensure_capacity(self, num_tokens: int) -> bool:
        """Grow for ``num_tokens`` tokens per rank (collective in real EP; a
        host sync: call it between steps, see ``Workspace.ensure_capacity``)."""
        grew = self.inner.ensure_capacity(num_tokens)
        if grew:
            self._allocate_local()
        return grew

    def poison(self) -> None:
        """NaN into every data buffer (tests)."""
        self.inner.poison()
        s = self.inner.shape
        for local in range(self.inner.num_local_ranks):
            self.inner.arena_view(local, "slot_copy", torch.int32, (s.slot_capacity,)).fill_(-1)
        self.dh1.fill_(float("nan"))
        self.dh3.fill_(float("nan"))
        self.ds_parts.fill_(float("nan"))
        self.slot_rows.fill_(float("nan"))
        self.g32.fill_(float("nan"))

    def check_errors(self) -> None:
        """Raise RuntimeError if a backward kernel of this rank timed out (syncs)."""
        self.inner.check_errors()

    def poll_errors(self) -> None:
        """Raise if a queued copy of the error record shows a failure (no sync;
        see ``Workspace.poll_errors``)."""
        self.inner.poll_errors()

    def wait_errors(self) -> None:
        """Wait for the queued copies of the error record and raise a failure
        they show (see ``Workspace.wait_errors``)."""
        self.inner.wait_errors()
