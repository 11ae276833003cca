"""Real-rank mode on one GPU: the EP path as the ranks of a real EP group run it.

    python -m titan_uniep.tools.real_ranks --world 2 --world 4 --world 8 --calls 1000
    python -m titan_uniep.tools.real_ranks --world 4 --case tiny --fail all

The simulated world (``Workspace.simulated``) launches every rank in one
kernel per phase (``NUM_LOCAL = W``, GPU scope, one arena allocation) and
runs the counts exchange as a publishing launch for all ranks, then a
collecting one. A rank of a real EP group launches other binaries: one rank
per launch (``NUM_LOCAL = 1``) at system scope, the counts exchange as one
launch (its parts, the ticket that elects the collector, the collector's
wait), and waits that spin on another rank's launch. This mode runs those
on one GPU: ``Workspace.ranks_in_process`` gives each rank its own arena (a
separate allocation, in shuffled order, so peer offsets are negative too),
and each rank's calls go to a CUDA stream of its own through
``runtime.moe_forward`` / ``moe_backward``, as the rank's process would
issue them, with grids small enough (``resident_grid``: the SMs divided by
W and by the most programs per SM) that every rank's spinning programs
are resident together in any mix of phases.

Each call: the ranks in a random order, each after a random delay on its
stream (``torch.cuda._sleep``); poisoned buffers (both workspaces, the
output, the saved h1 | h3); the fused forward and backward; then, on the
rank's stream, a bitwise comparison of the output and every gradient with
the sequential schedule of the simulated world on the same inputs, counted
on the device (no host sync). Calls cycle through ``--sets`` input sets
(other routings and token counts), so a call that reads an earlier call's
counts, slots or rows shows. Nothing synchronizes the streams between
calls: the ranks drift, up to a call apart. Every kernel a call launches is
compiled before the first call (``compile_launches``): a rank spinning on a
peer whose launch is still compiling would wait out the compile.

Failures (``--fail``), forward calls on fresh workspaces with a short wait
bound: a rank that never launches (``silent``); a token routed to an expert
that does not exist (``bad_slot``); a rank whose bound runs out in the
counts exchange while the others, with a longer bound, still wait there
(``exchange_abort``, W >= 3); a rank that launches but sends no row, so
the tiles waiting for its rows run out (``mid_tile``). Each must stop every
rank within twice the bound, name the first failing rank, its phase and
counter in every rank's error, and fail the next call before it launches.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field

import torch

from titan_uniep.kernels.scoreboard import CTL_EPOCH, CTL_ERROR, ERROR_FIELDS, FAILED, STOPPED
from titan_uniep.params import LayerParams, default_params
from titan_uniep.runtime import (BackwardWorkspace, Workspace, moe_backward, moe_forward, simulated_moe_backward,
                                 simulated_moe_forward)

OUTPUTS = ("out", "dx", "dscores", "dw1", "dw2", "dw3")
FAILURES = ("silent", "bad_slot", "exchange_abort", "mid_tile")

# CUDA gives a context CUDA_DEVICE_MAX_CONNECTIONS hardware work queues (default 8, at most
# 32, read when the context starts) and maps streams onto them in turn: two streams on one
# queue run in order, so a rank's launch queued behind another rank's spinning megakernel
# waits for it, and that kernel waits for this launch. W rank streams and the default stream
# need W + 1 queues (one H100: W = 8 with 8 queues stalled at the first backward exchange;
# with 32, 3,000 calls ran). Asked for here, before CUDA starts where it has not yet.
MAX_CONNECTIONS = 32
if not torch.cuda.is_initialized():
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", str(MAX_CONNECTIONS))
CONNECTIONS = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))


@dataclass(frozen=True)
class Case:
    """A layer of the stress runs: ``tokens[s][r]`` tokens of rank ``r`` in
    input set ``s`` come from ``token_cycle`` (rank r, set s: element
    ``(r + 3 s) % len``), ``empty_rank`` routes no token at all, ``skew``
    makes every token pick expert 0 (rank 0 receives every token)."""

    dim: int
    hidden: int
    num_experts: int
    top_k: int
    score_before: bool = False
    weight_grad_dtype: torch.dtype | None = None  # fp32: the Triton weight-gradient kernel
    token_cycle: tuple[int, ...] = (777, 1000, 513, 1024, 64, 300, 901, 1)
    empty_rank: int | None = None
    skew: bool = False

    def tokens(self, world: int, sets: int) -> list[list[int]]:
        cycle = self.token_cycle
        return [[0 if r == self.empty_rank else cycle[(r + 3 * s) % len(cycle)] for r in range(world)]
                for s in range(sets)]


CASES: dict[str, Case] = {
    # scores after the experts, bf16 weight gradients (torch._grouped_mm)
    "after": Case(dim=512, hidden=768, num_experts=32, top_k=4),
    # scores before the experts, fp32 weight gradients (the Triton kernel)
    "before": Case(dim=256, hidden=384, num_experts=16, top_k=3, score_before=True,
                   weight_grad_dtype=torch.float32),
    # a rank with no tokens, every token also on expert 0 (rank 0 receives them all)
    "empty_rank": Case(dim=1024, hidden=512, num_experts=64, top_k=8, empty_rank=1, skew=True,
                       token_cycle=(1024, 999, 517, 2048, 7)),
    # small enough for compute-sanitizer
    "tiny": Case(dim=64, hidden=96, num_experts=8, top_k=2, token_cycle=(40, 17, 33, 1, 25)),
}


@contextlib.contextmanager
def compile_launches():
    """Triton kernels launched inside compile (``JITFunction.run(warmup=True)``)
    and load into the context, but do not run: a pass through every launch
    of a call readies each binary it needs, at the arguments'
    specialisation, before any rank spins on another. Compiling at a first
    launch holds the host while a peer spins; so does loading: CUDA loads a
    module lazily, at its first use, and loading may wait for the kernels
    running in the context (CUDA's lazy-loading guide warns of exactly this
    deadlock for kernels that need each other running). Torch ops still run,
    on whatever the buffers hold, and so load their kernels too."""
    from triton.runtime.jit import KernelInterface

    launch = KernelInterface.__getitem__

    def compile_only(self, grid):
        def ready(*args, **kwargs):
            kernel = self.run(grid=grid, warmup=True, *args, **kwargs)
            kernel._init_handles()
            return kernel

        return ready

    KernelInterface.__getitem__ = compile_only
    try:
        yield
    finally:
        KernelInterface.__getitem__ = launch


def _inputs(case: Case, world: int, tokens: list[int], gen: torch.Generator, device, dtype) -> dict:
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    xs, grads, scores, indices = [], [], [], []
    for t in tokens:
        xs.append(randn(t, case.dim))
        grads.append(randn(t, case.dim))
        scores.append(0.05 + 0.9 * torch.rand(t, case.top_k, generator=gen, device=device))
        if case.skew:  # expert 0, then K - 1 distinct others
            others = 1 + torch.rand(t, case.num_experts - 1, generator=gen, device=device).argsort(1)
            picked = torch.cat([torch.zeros_like(others[:, :1]), others[:, : case.top_k - 1]], 1)
        else:
            picked = torch.rand(t, case.num_experts, generator=gen, device=device).argsort(1)[:, : case.top_k]
        indices.append(picked.contiguous())
    return dict(xs=xs, grads=grads, scores=scores, indices=indices)


@dataclass
class CallReport:
    """A stress run of one case and world size."""

    case: str
    world: int
    calls: int
    seconds_per_call: float
    mismatched_calls: int  # calls where some rank's output or gradient differs from the sequential schedule's
    first_mismatch: str | None
    simulated_fused_equals_sequential: bool
    arena_order: list[int]  # ranks by arena address, lowest first
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.mismatched_calls == 0 and self.simulated_fused_equals_sequential and not self.errors


def resident_grid(params: LayerParams, world: int, device: torch.device) -> int:
    """The per-rank grid that keeps every rank's spinning programs resident
    together, whatever phase each rank is in: the SMs divided by ``W`` and by
    the most programs per SM any megakernel launches (``*_programs_per_sm``).

    On its own GPU a rank runs one megakernel at a time, ``SMs x pps``
    programs that fit together. Here the ranks drift apart (up to a call),
    so one rank's dispatch_dh (2 programs per SM) meets another's
    fc2_combine (1): with grids of ``SMs / W`` the spinning programs could
    need up to twice the SMs (one H100, W = 4, grids of 33: a reduce waited
    out its bound at call 751 of 1,000; with grids of 16, 3,000 calls ran).
    At most one SM per spinning program and no more of them than SMs, every
    program finds an SM once the non-spinning kernels on it finish."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    most = max(params.fc2_programs_per_sm, params.dh_programs_per_sm, params.da_programs_per_sm)
    return max(1, sms // (world * most))


class RealRankWorld:
    """``world`` ranks of one ``case`` in this process (see the module docstring)."""

    def __init__(self, case_name: str, world: int, *, sets: int = 3, seed: int = 0, timeout_s: float = 5.0,
                 device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 hooks: dict | None = None, programs: int | None = None):
        self.case_name, self.case, self.world = case_name, CASES[case_name], world
        self.device = torch.device(device)
        case = self.case
        if case.num_experts % world:
            raise ValueError(f"case {case_name!r} has {case.num_experts} experts, not divisible by {world} ranks")
        if world + 1 > CONNECTIONS:
            raise RuntimeError(
                f"{world} ranks' streams and the default stream need {world + 1} CUDA work queues, and this process "
                f"has {CONNECTIONS} (CUDA_DEVICE_MAX_CONNECTIONS, read when CUDA starts): set "
                f"CUDA_DEVICE_MAX_CONNECTIONS={MAX_CONNECTIONS} before CUDA starts (import "
                f"titan_uniep.tools.real_ranks first), or two ranks share a queue and wait on each other")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.dtype = dtype
        el = case.num_experts // world
        d, h = case.dim, case.hidden
        w1 = (torch.randn(case.num_experts, h, d, generator=gen, device=self.device) * d**-0.5).to(dtype)
        w3 = (torch.randn(case.num_experts, h, d, generator=gen, device=self.device) * d**-0.5).to(dtype)
        w2 = (torch.randn(case.num_experts, d, h, generator=gen, device=self.device) * h**-0.5).to(dtype)
        self.weights = [tuple(w[r * el:(r + 1) * el].contiguous() for w in (w1, w2, w3)) for r in range(world)]
        self.sets = [_inputs(case, world, tokens, gen, self.device, dtype) for tokens in case.tokens(world, sets)]
        self.capacity = max(1, max(max(len(x) for x in s["xs"]) for s in self.sets))
        self.params = default_params(world, hidden=h).replace(timeout_s=timeout_s)
        # ``hooks``: testing hooks of the ranks' calls (``LayerParams.debug_*``); ``programs``: the
        # per-rank grid (default ``resident_grid``).
        self.programs = programs or resident_grid(self.params, world, self.device)
        self.rank_params = self.params.replace(num_programs=self.programs, **(hooks or {}))
        self.seed = seed
        # The sequential schedule of the simulated world is the reference; its fused schedule must equal it.
        self.references, self.fused_equals_sequential = [], True
        for inputs in self.sets:
            sequential, fused = self._simulated(inputs, "sequential"), self._simulated(inputs, "fused")
            self.fused_equals_sequential &= all(torch.equal(_bits(a), _bits(b))
                                                for ra, rb in zip(sequential, fused) for a, b in zip(ra, rb))
            self.references.append(sequential)
        self.fwd, self.bwd = self._workspaces(seed)
        self.streams = [torch.cuda.Stream(self.device) for _ in range(world)]
        slots = self.fwd[0].shape.slot_capacity
        self.h13 = [torch.empty(slots, 2 * h, dtype=dtype, device=self.device) for _ in range(world)]
        self.outs = [torch.empty(self.capacity, d, dtype=dtype, device=self.device) for _ in range(world)]

    # ---- references --------------------------------------------------------------

    def _simulated(self, inputs: dict, schedule: str) -> list[list[torch.Tensor]]:
        """Every rank's output and gradients from the simulated world (one launch runs all ranks)."""
        world, case = self.world, self.case
        w1s, w2s, w3s = ([w[i] for w in self.weights] for i in range(3))
        sizes = dict(num_tokens=self.capacity, dim=case.dim, hidden=case.hidden, num_experts=case.num_experts,
                     top_k=case.top_k, dtype=self.dtype, device=self.device, params=self.params)
        ws, bws = Workspace.simulated(world, **sizes), BackwardWorkspace.simulated(world, **sizes)
        h13 = torch.full((world, ws.shape.slot_capacity, 2 * case.hidden), float("nan"), dtype=self.dtype,
                         device=self.device)
        outs = simulated_moe_forward(inputs["xs"], inputs["scores"], inputs["indices"], w1s, w2s, w3s,
                                     schedule=schedule, score_before_experts=case.score_before, params=self.params,
                                     workspace=ws, saved_h13=h13)
        grads = simulated_moe_backward(inputs["grads"], inputs["xs"], inputs["scores"], inputs["indices"], w1s, w2s,
                                       w3s, schedule=schedule, score_before_experts=case.score_before,
                                       params=self.params, workspace=bws, saved_h13=h13,
                                       weight_grad_dtype=case.weight_grad_dtype)
        return [[outs[r].clone(), *(g.clone() for g in grads[r])] for r in range(world)]

    # ---- the ranks ------------------------------------------------------------------

    def _workspaces(self, seed: int, params: LayerParams | None = None, backward: bool = True):
        """Every rank's forward workspace and (``backward``) backward workspace."""
        case, p = self.case, params or self.rank_params
        sizes = dict(num_tokens=self.capacity, dim=case.dim, hidden=case.hidden, num_experts=case.num_experts,
                     top_k=case.top_k, dtype=self.dtype, device=self.device, params=p, seed=seed)
        fwd = Workspace.ranks_in_process(self.world, **sizes)
        bwd = BackwardWorkspace.ranks_in_process(self.world, **{**sizes, "seed": seed + 1}) if backward else None
        return fwd, bwd

    def arena_order(self) -> list[int]:
        """The ranks by the address of their forward arenas, lowest first."""
        return sorted(range(self.world), key=lambda r: self.fwd[r].arena.data_ptr())

    def forward(self, rank: int, inputs: dict, params: LayerParams | None = None, fwd=None) -> torch.Tensor:
        """One rank's fused forward (lazy error check: no host sync) into its poisoned output."""
        w1, w2, w3 = self.weights[rank]
        out = self.outs[rank][: len(inputs["xs"][rank])]
        out.fill_(float("nan"))
        self.h13[rank].fill_(float("nan"))
        return moe_forward(inputs["xs"][rank], inputs["scores"][rank], inputs["indices"][rank], w1, w2, w3,
                           workspace=(fwd or self.fwd)[rank], schedule="fused",
                           score_before_experts=self.case.score_before, params=params or self.rank_params, out=out,
                           error_check="lazy", saved_h13=self.h13[rank])

    def backward(self, rank: int, inputs: dict) -> tuple[torch.Tensor, ...]:
        w1, w2, w3 = self.weights[rank]
        return moe_backward(inputs["grads"][rank], inputs["xs"][rank], inputs["scores"][rank],
                            inputs["indices"][rank], w1, w2, w3, workspace=self.bwd[rank], schedule="fused",
                            score_before_experts=self.case.score_before, params=self.rank_params,
                            error_check="lazy", saved_h13=self.h13[rank],
                            weight_grad_dtype=self.case.weight_grad_dtype)

    def call(self, rank: int, set_index: int, mismatches: torch.Tensor, delays: tuple[int, int] = (1, 1)) -> None:
        """One rank's call on its stream: delay, poison, forward, delay, backward,
        then the mismatch count of each output into ``mismatches`` ``(len(OUTPUTS),)``."""
        inputs = self.sets[set_index]
        with torch.cuda.stream(self.streams[rank]):
            torch.cuda._sleep(delays[0])
            self.fwd[rank].poison()
            self.bwd[rank].poison()
            out = self.forward(rank, inputs)
            torch.cuda._sleep(delays[1])
            grads = self.backward(rank, inputs)
            ref = self.references[set_index][rank]
            mismatches.copy_(torch.stack([(_bits(a) != _bits(b)).sum() for a, b in zip((out, *grads), ref)]))

    def compile(self) -> None:
        """Compile and load every launch of every rank and input set (``compile_launches``)."""
        scratch = torch.zeros(len(OUTPUTS), dtype=torch.int64, device=self.device)
        with compile_launches():
            for s in range(len(self.sets)):
                for rank in range(self.world):
                    self.call(rank, s, scratch)
        torch.cuda.synchronize(self.device)

    def run(self, calls: int, *, max_delay_us: float = 200.0, seed: int = 0, progress=None) -> CallReport:
        """``calls`` consecutive calls of every rank (see the module docstring)."""
        rng = random.Random(seed)
        cycles_per_us = getattr(torch.cuda.get_device_properties(self.device), "clock_rate", 1_755_000) / 1000
        mismatches = torch.zeros(calls, self.world, len(OUTPUTS), dtype=torch.int64, device=self.device)
        for stream in self.streams:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        errors = []
        start = time.perf_counter()
        try:
            for c in range(calls):
                ranks = list(range(self.world))
                rng.shuffle(ranks)
                for rank in ranks:
                    delays = tuple(1 + int(rng.random() * max_delay_us * cycles_per_us) for _ in range(2))
                    self.call(rank, c % len(self.sets), mismatches[c, rank], delays)
                if progress is not None:
                    progress(c)
            for stream in self.streams:
                torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            for ws in (*self.fwd, *self.bwd):
                ws.wait_errors()
        except RuntimeError as err:
            torch.cuda.synchronize(self.device)
            errors.append(str(err))
        elapsed = time.perf_counter() - start
        bad = (mismatches.sum((1, 2)) > 0).nonzero().flatten().tolist()
        first = None
        if bad:
            c = bad[0]
            where = [(r, OUTPUTS[j], int(mismatches[c, r, j])) for r in range(self.world) for j in range(len(OUTPUTS))
                     if mismatches[c, r, j]]
            first = f"call {c} (input set {c % len(self.sets)}): " + ", ".join(
                f"rank {r} {name} ({n} elements)" for r, name, n in where)
        return CallReport(self.case_name, self.world, calls, elapsed / calls, len(bad), first,
                          self.fused_equals_sequential, self.arena_order(), errors)

    # ---- failures -------------------------------------------------------------------

    def inject(self, failure: str, bound_s: float = 0.5) -> "FailureReport":
        """One forward call of every rank on fresh workspaces with wait bound
        ``bound_s``, under ``failure`` (one of ``FAILURES``)."""
        world = self.world
        faulty = world - 1  # the rank that fails (or is silent)
        params = [self.rank_params.replace(timeout_s=bound_s)] * world
        inputs = dict(self.sets[0])
        launching = list(range(world))
        if failure == "silent":
            launching.remove(faulty)
        elif failure == "bad_slot":
            indices = list(inputs["indices"])
            indices[faulty] = indices[faulty].clone()
            indices[faulty][0, 0] = self.case.num_experts  # experts are 0..E-1
            inputs["indices"] = indices
        elif failure == "exchange_abort":
            if world < 3:
                raise ValueError("exchange_abort needs W >= 3: a silent rank, one that runs out, one stopped")
            launching.remove(faulty)
            params = [params[0].replace(timeout_s=bound_s if r == 0 else 8 * bound_s) for r in range(world)]
        elif failure == "mid_tile":
            params = [p.replace(debug_silent_rank=faulty) for p in params]
        else:
            raise ValueError(f"failure must be one of {FAILURES}, got {failure!r}")
        fwd, _ = self._workspaces(self.seed + 10, params[0], backward=False)  # (the failures are forward calls)
        with compile_launches():
            for rank in launching:
                with torch.cuda.stream(self.streams[rank]):
                    self.forward(rank, inputs, params[rank], fwd)
        torch.cuda.synchronize(self.device)
        for stream in self.streams:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        start = time.perf_counter()
        for rank in launching:
            with torch.cuda.stream(self.streams[rank]):
                self.forward(rank, inputs, params[rank], fwd)
        for stream in self.streams:
            stream.synchronize()
        stopped_after = time.perf_counter() - start
        records = [dict(zip(ERROR_FIELDS, fwd[r].control[0, CTL_ERROR:CTL_ERROR + len(ERROR_FIELDS)].tolist()))
                   for r in range(world)]
        # The next call of a rank that ran: its lazy check (the copy its failed call queued
        # has landed) must raise before it launches anything.
        next_call_raised = []
        for rank in launching:
            epoch = int(fwd[rank].control[0, CTL_EPOCH])
            try:
                with torch.cuda.stream(self.streams[rank]):
                    self.forward(rank, inputs, params[rank], fwd)
                next_call_raised.append(False)
            except RuntimeError:
                next_call_raised.append(int(fwd[rank].control[0, CTL_EPOCH]) == epoch)
        torch.cuda.synchronize(self.device)
        messages = []
        for rank in range(world):
            try:
                fwd[rank].check_errors()
                messages.append("")
            except RuntimeError as err:
                messages.append(str(err))
        return FailureReport(failure, world, bound_s, stopped_after, launching, records, messages,
                             all(next_call_raised))


@dataclass
class FailureReport:
    failure: str
    world: int
    bound_s: float
    stopped_after_s: float  # from the first launch until every launching rank's stream is done
    launching: list[int]
    records: list[dict]  # every rank's error record (flag, rank, task, what, index, expected, seen, epoch)
    messages: list[str]  # every rank's check_errors() message ("" if it raised none)
    next_call_raised: bool  # every launching rank's next call raised before launching

    @property
    def root(self) -> int | None:
        """The rank every message names as the first to fail (None if they disagree or none does)."""
        named = {m.group(1) for text in self.messages for m in [re.search(r"EP rank (\d+) failed first", text)] if m}
        named |= {m.group(1) for text in self.messages
                  for m in [re.search(r"failed on EP rank (\d+) .*It failed first", text)] if m}
        return int(named.pop()) if len(named) == 1 else None

    def problems(self) -> list[str]:
        """What this run got wrong against the failure contract (empty: all kept)."""
        found = []
        if self.stopped_after_s > 2 * self.bound_s:
            found.append(f"the ranks stopped after {self.stopped_after_s:.3f} s, beyond twice the bound "
                         f"({2 * self.bound_s:.3f} s)")
        root = self.root
        if root is None:
            found.append("the ranks' errors do not name one first failing rank")
        elif self.records[root]["flag"] != FAILED:
            found.append(f"rank {root} is named first but its record says {self.records[root]}")
        for rank, text in enumerate(self.messages):
            if not text:
                found.append(f"rank {rank} reported no error")
        stopped = [r for r in self.launching if self.records[r]["flag"] == STOPPED]
        failed = [r for r in self.launching if self.records[r]["flag"] == FAILED]
        if not failed:
            found.append("no launching rank recorded a failure of its own")
        if not self.next_call_raised:
            found.append("a rank's next call did not raise")
        expected_phase = {"silent": "count_flags", "exchange_abort": "count_flags", "bad_slot": "outside the receive "
                          "buffer", "mid_tile": "tile_arrivals"}[self.failure]
        if root is not None and not all(expected_phase in text for text in self.messages):
            found.append(f"not every error names the first failure's counter ({expected_phase})")
        if self.failure == "exchange_abort" and len(stopped) < len(self.launching) - 1:
            found.append(f"the abort word stopped {stopped}, not every rank but the first to fail")
        return found


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers (NaNs compare by bits too)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_uniep.tools.real_ranks", description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, action="append", help="EP size W (repeatable; default 2, 4, 8)")
    parser.add_argument("--case", action="append", choices=[*CASES, "all"],
                        help="layer case (repeatable; default after, before, empty_rank)")
    parser.add_argument("--calls", type=int, default=100, help="consecutive calls of every rank")
    parser.add_argument("--sets", type=int, default=3, help="input sets the calls cycle through")
    parser.add_argument("--max-delay-us", type=float, default=200.0, help="random delay before a rank's launches")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="wait bound of the stress calls")
    parser.add_argument("--fail", action="append", choices=[*FAILURES, "all"],
                        help="inject failures instead of the stress calls (repeatable)")
    parser.add_argument("--bound-s", type=float, default=0.5, help="wait bound of the failure calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--programs", type=int, default=None,
                        help="per-rank grid (default: resident_grid, the SMs divided by W and by the most programs "
                             "per SM)")
    parser.add_argument("--compile-only", action="store_true",
                        help="build the worlds and compile their kernels into Triton's cache, run no call "
                             "(several at once fill the cache in parallel)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("real-rank mode runs the GPU binaries: it needs a CUDA GPU")
    worlds = args.world or [2, 4, 8]
    cases = [c for c in (args.case or ["after", "before", "empty_rank"]) if c != "all"] or \
        ["after", "before", "empty_rank"]
    if args.case and "all" in args.case:
        cases = list(CASES)
    failures = [f for f in (args.fail or []) if f != "all"] + (list(FAILURES) if args.fail and "all" in args.fail
                                                               else [])
    status = 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for case in cases:
        for world in worlds:
            if CASES[case].num_experts % world:
                print(f"{case} W={world}: skipped ({CASES[case].num_experts} experts)", flush=True)
                continue
            rr = RealRankWorld(case, world, sets=args.sets, seed=args.seed, timeout_s=args.timeout_s,
                               programs=args.programs)
            rr.compile()
            if args.compile_only:
                print(f"COMPILED {case} W={world}", flush=True)
                continue
            if failures:
                for failure in failures:
                    if failure == "exchange_abort" and world < 3:
                        continue
                    report = rr.inject(failure, args.bound_s)
                    problems = report.problems()
                    status |= bool(problems)
                    first = report.messages[report.root].splitlines()[0] if report.root is not None else "?"
                    print(f"FAIL-INJECT {case} W={world} {failure}: stopped after {report.stopped_after_s:.3f} s "
                          f"(bound {report.bound_s} s), first failing rank {report.root}, next call raised "
                          f"{report.next_call_raised}: {'OK' if not problems else '; '.join(problems)}\n  {first}",
                          flush=True)
                continue
            report = rr.run(args.calls, max_delay_us=args.max_delay_us, seed=args.seed)
            status |= not report.ok
            print(f"STRESS {case} W={world} (grid {rr.programs} per rank): {report.calls} calls, "
                  f"{report.seconds_per_call * 1e3:.2f} ms per call "
                  f"(all ranks, fwd + bwd), mismatched calls {report.mismatched_calls}, simulated fused == "
                  f"sequential {report.simulated_fused_equals_sequential}, arenas by address {report.arena_order}"
                  + (f"; first mismatch {report.first_mismatch}" if report.first_mismatch else "")
                  + (f"; errors: {report.errors}" if report.errors else ""), flush=True)
            del rr
            torch.cuda.empty_cache()
    return status


if __name__ == "__main__":
    sys.exit(main())
