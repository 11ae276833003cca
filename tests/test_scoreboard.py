"""The megakernels' synchronisation on simulated worlds (CPU, Triton interpreter): races and faults.

Races. The interpreter runs a grid's programs one after another and the
simulated world claims every producer task first, so "fused == sequential"
holds there whatever the waits do. Race mode (``LayerParams.debug_race``,
``kernels.scoreboard``) lets consumers run before their producers are done:
each producer delivers a seeded random subset of its rows, every tile-rows
and token-rows wait polls once (not ready: skipped), and a task that passed
its wait checks the arrival stamp of every row it reads. The shipped waits
give no violation (W = 1, 2, 4, fc2 tiles claimed or in the flattened loop,
with and without the deferred release, forward and backward); waits one
arrival short (``debug_wait_slack = 1``, a race on a GPU) are caught in fc1
and dH tiles and in both reduces.

Faults. The first rank whose wait runs out (or whose dispatch meets a bad
slot) claims the group's first failure and sets every rank's abort word;
every other wait gives up at once and records that it *stopped*; every
rank's error names the rank, task and counter that failed first; the lazy
error check (the fused path's default) reports it at the next call or at the
trainer's per-step check (``titan_uniep.op.end_step``). Where a
wait that ignored the abort word would spin, the spin bound is 10^5 polls
(about 25 CPU-seconds a wait here), so a regression shows as a ``FAILED``
record where ``STOPPED`` is expected, and as time.
"""

from interpreter_env import request_interpreter

request_interpreter()  # before anything defines a Triton kernel

import re
import time
from types import SimpleNamespace

import pytest
from torchtitan_release import torchtitan_0_2
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from titan_uniep.kernels.scoreboard import (
    ABORT_FIELDS,
    BAD_SLOT,
    CTL_EPOCH,
    CTL_ERROR,
    ERROR_FIELDS,
    FAILED,
    STOPPED,
    WAIT_COUNTS_FLAG,
    WAIT_TILE_ROWS,
    WAIT_TOKEN_ROWS,
    Route,
    wait_counter_at_least,
    wait_counters_at_least,
)
from titan_uniep.params import interpreter_params
from titan_uniep.runtime import BackwardWorkspace, Workspace, simulated_moe_backward, simulated_moe_forward

import worlds

if torch.cuda.is_available():
    pytest.skip("CPU interpreter tests (GPU runs use tests/gpu/)", allow_module_level=True)
if not isinstance(tl.standard.cdiv, InterpretedFunction):
    pytest.skip("Triton was imported before TRITON_INTERPRET=1; run in a subprocess", allow_module_level=True)

# Each test here takes at most about 3 s on a 2-core CPU (most of that the first TorchTitan
# import), so that a wait that no longer ends (its poll bound broken) fails in 30 s, not at
# pyproject's 900.
pytestmark = pytest.mark.timeout(30)

DIM, HIDDEN = 32, 48
SLOW = 100_000  # polls: a wait that spins to this bound takes about 25 CPU-seconds in the interpreter


def make_world(world, num_experts, top_k, num_tokens, *, seed):
    """Random inputs of a simulated world (``worlds.make_world`` at this file's dims, fp32)."""
    return worlds.make_world(world, num_experts, top_k, num_tokens, seed=seed, dim=DIM, hidden=HIDDEN)


def forward(w, ws, params, **kwargs):
    return simulated_moe_forward(w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule="fused",
                                 score_before_experts=False, params=params, workspace=ws, **kwargs)


def error_records(ws):
    return [dict(zip(ERROR_FIELDS, row)) for row in ws.control[:, CTL_ERROR:CTL_ERROR + len(ERROR_FIELDS)].tolist()]


def abort_records(ws):
    return [dict(zip(ABORT_FIELDS, row)) for row in ws.abort_words.tolist()]


def assert_every_rank_names(ws, root_rank):
    """Every rank's abort words hold ``root_rank``'s failure, as its error record has it."""
    root = error_records(ws)[root_rank - ws.rank_base]
    assert root["flag"] == FAILED, root
    for r, abort in enumerate(abort_records(ws)):
        assert abort["code"] == root_rank + 1, f"rank {r}: {abort}"
        got = tuple(abort[k] for k in ("rank", "epoch", "task", "what", "index", "expected", "seen"))
        assert got == tuple(root[k] for k in ("rank", "epoch", "task", "what", "index", "expected", "seen")), \
            f"rank {r}: {abort} vs {root}"
    return root


# ---- races ---------------------------------------------------------------------

# Producers deliver 95% of their rows; two tokens per reduce task, so that with
# these tiny worlds some tasks of every kind find their rows complete.
RACE = dict(debug_race=True, debug_race_keep=0.95, reduce_block_tokens=2)
WORLDS = {1: (4, 3, [13]), 2: (8, 3, [13, 9]), 4: (8, 3, [7, 11, 5, 9])}  # world: experts, top_k, tokens


def race_totals(ws):
    """The race report summed over the ranks, and each rank's first violation."""
    reports = ws.race_report()
    counts = {k: sum(r[k] for r in reports) for k in reports[0] if k.endswith(("skipped", "passed", "violations"))}
    return counts, [(r["first_what"], r["first_index"], r["first_row"]) for r in reports]


def assert_clean(counts):
    assert counts["tile_violations"] == counts["token_violations"] == 0, counts
    # The check ran: some tasks found their rows incomplete, some complete, of both kinds.
    assert min(counts[f"{kind}_{what}"] for kind in ("tile", "token") for what in ("skipped", "passed")) > 0, counts


def assert_caught(ws, counts, firsts):
    """Both kinds of waits were caught passing early, and each rank's first
    violation names a row that had not arrived."""
    assert counts["tile_violations"] > 0 and counts["token_violations"] > 0, counts
    epoch = int(ws.control[0, CTL_EPOCH])
    for r, (what, index, row) in enumerate(firsts):
        if what == WAIT_TILE_ROWS:
            assert int(ws.arena_view(r, "slot_stamps", torch.int32, (ws.shape.slot_capacity,))[row]) != epoch
        elif what == WAIT_TOKEN_ROWS:
            assert row // ws.shape.top_k == index
        else:
            assert what == 0, firsts


def race_forward(world, fc2, slack, seed=0):
    num_experts, top_k, tokens = WORLDS[world]
    w = make_world(world, num_experts, top_k, tokens, seed=40 + world)
    params = interpreter_params(**fc2, debug_race_seed=seed, debug_wait_slack=slack, **RACE)
    ws = Workspace.simulated(world, num_tokens=max(tokens), dim=DIM, hidden=HIDDEN, num_experts=num_experts,
                             top_k=top_k, dtype=torch.float32, params=params)
    ws.poison()
    forward(w, ws, params)  # (the sync check: race mode records no failure)
    return ws, *race_totals(ws)


def random_h13(bws):
    """A saved h1 | h3 buffer for backward runs that check where rows come from
    or how a wait fails, not the values (any values do)."""
    return torch.randn(bws.world_size, bws.inner.shape.slot_capacity, 2 * HIDDEN)


def race_backward(world, slack, seed=0):
    num_experts, top_k, tokens = WORLDS[world]
    w = make_world(world, num_experts, top_k, tokens, seed=50 + world)
    params = interpreter_params(debug_race_seed=seed, debug_wait_slack=slack, **RACE)
    bws = BackwardWorkspace.simulated(world, num_tokens=max(tokens), dim=DIM, hidden=HIDDEN, num_experts=num_experts,
                                      top_k=top_k, dtype=torch.float32, params=params)
    bws.poison()
    simulated_moe_backward(w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                           schedule="fused", score_before_experts=False, params=params, workspace=bws,
                           saved_h13=random_h13(bws), poison_outputs=True)
    return bws.inner, *race_totals(bws.inner)


@pytest.mark.parametrize("world,fc2", [(1, {}), (2, {}), (2, dict(fc2_defer_release=True)),
                                       (4, dict(fc2_defer_release=True, fc2_flat_loop=True))])
def test_race_mode_finds_no_early_consumer_in_the_forward(world, fc2):
    _, counts, _ = race_forward(world, fc2, slack=0)
    assert_clean(counts)


@pytest.mark.parametrize("fc2", [{}, dict(fc2_flat_loop=True)], ids=["claims", "flat_loop"])
def test_race_mode_catches_forward_waits_one_arrival_short(fc2):
    """The mutation CI could not see: every fc1 tile waits for one row fewer
    than it holds, every reduce for one expert row (column block) fewer than
    its tokens' K. Race mode reports both."""
    ws, counts, firsts = race_forward(2, fc2, slack=1)
    assert_caught(ws, counts, firsts)


def test_race_mode_finds_no_early_consumer_in_the_backward():
    _, counts, _ = race_backward(4, slack=0)
    assert_clean(counts)


def test_race_mode_catches_backward_waits_one_arrival_short():
    """dH tiles one [x | dOut] row short, the dA reduce one row short: both reported."""
    ws, counts, firsts = race_backward(2, slack=1)
    assert_caught(ws, counts, firsts)


def test_race_mode_needs_a_workspace_built_for_it():
    params = interpreter_params(**RACE)
    plain = Workspace.simulated(2, num_tokens=4, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3, dtype=torch.float32,
                                params=interpreter_params())
    w = make_world(2, 8, 3, [4, 3], seed=1)
    with pytest.raises(ValueError, match="debug_race needs a workspace built with it"):
        forward(w, plain, params)
    assert plain.memory_bytes()["slot_stamps"] == plain.memory_bytes()["row_stamps"] == 0


# ---- faults ---------------------------------------------------------------------


@triton.jit
def _scalar_wait(counter, abort, out, expected, polls):
    seen, stopped = wait_counter_at_least(counter, expected, abort, polls, False, "gpu")
    tl.store(out, seen)
    tl.store(out + 1, stopped)


@triton.jit
def _block_wait(counters, abort, out, expected, polls, N: tl.constexpr):
    offs = tl.arange(0, N)
    seen, stopped = wait_counters_at_least(counters + offs, offs < N, expected, abort, polls, False, "gpu")
    tl.store(out + offs, seen)
    tl.store(out + N, stopped)


@pytest.mark.timeout(10)  # measured 0.1 s; a wait that ignores its bound spins until this timeout
@pytest.mark.parametrize("block", [False, True], ids=["scalar", "block"])
def test_a_wait_whose_counter_never_arrives_gives_up_after_its_poll_bound(block):
    """Where no rank fails (the abort word stays clear), the poll bound alone
    ends a wait for a counter that never arrives (50 polls here): the wait
    returns what it saw, short, and that it did not stop on the abort word.
    The fault tests below end their waits on the abort word or on the scalar
    wait's bound; no other test lets a reduce task's block wait run out."""
    abort = torch.zeros(1, dtype=torch.int64)
    if block:
        counters = torch.tensor([5, 2, 7, 4], dtype=torch.int32)  # two of four short of 5
        out = torch.full((5,), -1, dtype=torch.int32)
        _block_wait[(1,)](counters, abort, out, 5, 50, 4)
        assert out.tolist() == [5, 2, 7, 4, 0]
    else:
        out = torch.full((2,), -1, dtype=torch.int32)
        _scalar_wait[(1,)](torch.tensor([2], dtype=torch.int32), abort, out, 5, 50)
        assert out.tolist() == [2, 0]


def test_silent_rank_stops_every_rank_with_the_root_cause():
    """Rank 1 sends nothing: rank 0's first fc1 tile (its rows come from both
    ranks) runs out first; rank 1's own tiles, which wait for its own unsent
    rows, then stop on the abort word (no wait of their own)."""
    w = make_world(2, 8, 3, [6, 6], seed=31)
    params = interpreter_params(debug_silent_rank=1, interpreter_max_spins=3)
    ws = Workspace.simulated(2, num_tokens=6, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3, dtype=torch.float32,
                             params=params)
    with pytest.raises(RuntimeError) as raised:
        forward(w, ws, params)
    root = assert_every_rank_names(ws, 0)
    assert root["what"] == WAIT_TILE_ROWS
    stopped = error_records(ws)[1]
    assert stopped["flag"] == STOPPED and stopped["what"] == WAIT_TILE_ROWS, stopped
    first, second = str(raised.value).splitlines()[:2]
    counter = rf"tile_arrivals\[{root['index']}\]"
    assert re.match(rf"UniEP forward failed on EP rank 0 \(call epoch 1, task {root['task']}\): dispatch_fc1 "
                    rf"\(fc1 tile\), .*{counter}.*; expected {root['expected']}, saw {root['seen']} after 3 polls\. "
                    r"It failed first", first), first
    assert re.match(rf"UniEP forward stopped on EP rank 1 \(call epoch 1, task {stopped['task']}\), in .*"
                    rf"because EP rank 0 failed first \(call epoch 1, task {root['task']}\): .*{counter}", second), \
        second


@torchtitan_0_2  # the 0.2.2 edge's trainer
def test_lazy_check_reports_the_failure_at_the_next_call_and_at_the_step_end(monkeypatch):
    """The fused path's lazy check: the failing call returns (no host sync),
    its output holds rows no reduce task wrote, and the failure is raised by
    the next call's poll and by the trainer's per-step check, on every rank
    with the root cause."""
    from titan_uniep import op
    from titan_uniep.torchtitan.v0_2 import train

    w = make_world(2, 8, 3, [6, 6], seed=31)
    params = interpreter_params(debug_silent_rank=1, interpreter_max_spins=3)
    ws = Workspace.simulated(2, num_tokens=6, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3, dtype=torch.float32,
                             params=params)
    out = torch.full((2, 6, DIM), float("nan"))
    forward(w, ws, params, out=out, error_check="lazy")  # does not raise
    assert torch.isnan(out).any(), "every row was written although a rank sent nothing"
    assert error_records(ws)[0]["flag"] == FAILED
    root = r"EP rank 0 failed first \(call epoch 1, task \d+\): dispatch_fc1 \(fc1 tile\), .*tile_arrivals\[\d+\]"
    with pytest.raises(RuntimeError, match=root):
        forward(w, ws, params, error_check="lazy")  # the poll at entry: before any launch
    assert ws.control[0, CTL_EPOCH].item() == 1, "the failing workspace started another call"
    monkeypatch.setattr(op, "_workspaces", {"layer": ws})
    with pytest.raises(RuntimeError, match=root):
        op.raise_pending_errors()
    # The trainer's per-step check (TorchTitan's step itself stubbed out).
    monkeypatch.setattr(train.Trainer, "train_step", lambda self, data_iterator: None)
    trainer = train.LossRecordingTrainer.__new__(train.LossRecordingTrainer)
    trainer.model_parts = []  # no model: only the per-step check runs
    with pytest.raises(RuntimeError, match=root):
        trainer.train_step(iter(()))


def _failed_workspace(seed):
    """A forward workspace whose last (lazily checked) call failed: rank 1 sent nothing."""
    w = make_world(2, 8, 3, [6, 6], seed=seed)
    params = interpreter_params(debug_silent_rank=1, interpreter_max_spins=3)
    ws = Workspace.simulated(2, num_tokens=6, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3, dtype=torch.float32,
                             params=params)
    forward(w, ws, params, error_check="lazy")  # does not raise
    return ws


ROOT_CAUSE = r"EP rank 0 failed first \(call epoch 1, task \d+\): dispatch_fc1 \(fc1 tile\)"


def test_step_end_check_raises_at_the_next_steps_first_call(monkeypatch):
    """``op.end_step`` does not sync; the op's next call, whichever workspace it
    uses, waits for the copies of every workspace and raises before it
    launches. Without calls of the op since the last check (a CUDA-graph
    replay), ``end_step`` checks at once."""
    from titan_uniep import op

    monkeypatch.setattr(op, "_workspaces", {"failed (another layer shape or the backward)": _failed_workspace(37)})
    monkeypatch.setattr(op, "_host_calls", 0)
    monkeypatch.setattr(op, "_check_at_next_call", False)
    op._check_step_copies()  # a call of the step: counted, nothing to wait for yet
    op.end_step()  # no sync, no raise
    with pytest.raises(RuntimeError, match=ROOT_CAUSE):
        op._check_step_copies()  # the next step's first call, at the op's entry
    monkeypatch.setattr(op, "_host_calls", 0)
    with pytest.raises(RuntimeError, match=ROOT_CAUSE):
        op.end_step()  # no call ran its Python this step: checked at once


@torchtitan_0_2  # the 0.2.2 edge's trainer
@pytest.mark.parametrize("checkpoint_due", [False, True])
def test_trainer_checks_before_a_checkpoint_and_defers_otherwise(monkeypatch, checkpoint_due):
    """After a step with a failed call, the trainer raises at once where a
    checkpoint follows the step (or it is the last), and otherwise leaves it
    to the next step's first MoE call."""
    from titan_uniep import op
    from titan_uniep.torchtitan.v0_2 import train

    monkeypatch.setattr(op, "_workspaces", {"layer": _failed_workspace(41)})
    monkeypatch.setattr(op, "_host_calls", 4)  # the step's MoE calls ran on the host
    monkeypatch.setattr(op, "_check_at_next_call", False)
    monkeypatch.setattr(train.Trainer, "train_step", lambda self, data_iterator: None)
    trainer = train.LossRecordingTrainer.__new__(train.LossRecordingTrainer)
    trainer.model_parts = []
    trainer.step = 3
    trainer.job_config = SimpleNamespace(training=SimpleNamespace(steps=10))
    trainer.checkpointer = SimpleNamespace(_should_save=lambda step, last_step=False: checkpoint_due)
    if checkpoint_due:
        with pytest.raises(RuntimeError, match=ROOT_CAUSE):
            trainer.train_step(iter(()))
        return
    trainer.train_step(iter(()))
    with pytest.raises(RuntimeError, match=ROOT_CAUSE):
        op._check_step_copies()


def test_backward_silent_rank_lazy_check_names_the_root_cause():
    w = make_world(2, 8, 3, [6, 6], seed=33)
    params = interpreter_params(debug_silent_rank=1, interpreter_max_spins=3)
    bws = BackwardWorkspace.simulated(2, num_tokens=6, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3,
                                      dtype=torch.float32, params=params)
    simulated_moe_backward(w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                           schedule="fused", score_before_experts=False, params=params, workspace=bws,
                           saved_h13=random_h13(bws), error_check="lazy")
    root = assert_every_rank_names(bws.inner, 0)
    assert error_records(bws.inner)[1]["flag"] == STOPPED
    with pytest.raises(RuntimeError) as raised:
        bws.check_errors()
    first, second = str(raised.value).splitlines()[:2]
    assert first.startswith("UniEP backward failed on EP rank 0") and "It failed first" in first, first
    assert re.match(rf"UniEP backward stopped on EP rank 1 .*because EP rank 0 failed first \(call epoch 1, task "
                    rf"{root['task']}\): dispatch_dh \(dH tile\), waiting for the dispatched \[x \| dOut\] rows of "
                    rf"tile {root['index']}", second), second


def test_bad_slot_stops_every_wait_at_once():
    """Rank 1 routes a token to an expert that does not exist: its dispatch
    fails without any wait and sends no more; rank 0's tiles that wait for
    those rows give up on the abort word at once (with 10^5-poll bounds)."""
    w = make_world(2, 8, 3, [6, 6], seed=32)
    w["indices"][1][2, 0] = 8  # experts are 0..7
    params = interpreter_params(interpreter_max_spins=SLOW)
    ws = Workspace.simulated(2, num_tokens=6, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3, dtype=torch.float32,
                             params=params)
    start = time.process_time()
    with pytest.raises(RuntimeError) as raised:
        forward(w, ws, params)
    elapsed = time.process_time() - start
    root = assert_every_rank_names(ws, 1)
    assert (root["what"], root["index"]) == (BAD_SLOT, 2), root
    stopped = error_records(ws)[0]
    assert stopped["flag"] == STOPPED and stopped["what"] == WAIT_TILE_ROWS, stopped
    first, second = str(raised.value).splitlines()[:2]
    assert re.match(r"UniEP forward failed on EP rank 1 .*: dispatch_fc1 \(dispatch\): token 2 has a copy whose slot "
                    r"is outside the receive buffer.*It failed first", first), first
    assert re.match(r"UniEP forward stopped on EP rank 0 .* because EP rank 1 failed first .*token 2", second), second
    assert elapsed < 15, f"{elapsed:.1f} CPU-s: a wait spun towards its bound"


def rank_view(ws, r):
    """Local rank ``r`` of a simulated workspace as a real-EP rank sees it
    (L = 1, rank_base = r) on the shared arenas, for driving its route
    kernels on its own."""
    names = ("control", "counts_all", "num_tokens", "block_counts", "route_tables", "dest_rank", "dest_slot",
             "dest_tile", "tile_expert", "tile_start", "tile_end", "num_tiles", "tile_order")
    sliced = {name: getattr(ws, name)[r:r + 1] for name in names}
    route_args = Route(*(v[r:r + 1] if isinstance(v, torch.Tensor) else v for v in ws.route_args))
    return SimpleNamespace(shape=ws.shape, arena_args=ws.arena_args, route_args=route_args, device=ws.device,
                           anchor_rank=ws.anchor_rank, rank_base=r, num_local_ranks=1, **sliced)


def test_counts_exchange_stops_on_the_abort_word_and_later_calls_do_not_wait():
    """W = 3, rank 2 never reaches the layer. Rank 0 collects first and runs
    out waiting for rank 1's counts; rank 1 then collects (10^5-poll bound)
    and gives up on rank 2 at once; rank 2 learns from its abort word alone;
    a later call on the failed workspace does not wait at all."""
    from titan_uniep.runtime.launch import route

    w = make_world(3, 6, 2, [5, 7, 4], seed=34)
    ws = Workspace.simulated(3, num_tokens=7, dim=DIM, hidden=HIDDEN, num_experts=6, top_k=2, dtype=torch.float32,
                             params=interpreter_params())
    views = [rank_view(ws, r) for r in range(3)]
    steps = ("count", "publish", "collect")
    indices = [idx.unsqueeze(0) for idx in w["indices"]]
    route(views[0], indices[0], 5, interpreter_params(interpreter_max_spins=3), steps=steps)
    start = time.process_time()
    route(views[1], indices[1], 7, interpreter_params(interpreter_max_spins=SLOW), steps=steps)
    route(views[0], indices[0], 5, interpreter_params(interpreter_max_spins=SLOW), steps=steps)  # a later call
    elapsed = time.process_time() - start
    root = assert_every_rank_names(ws, 0)
    assert (root["what"], root["index"], root["task"]) == (WAIT_COUNTS_FLAG, 1, -1), root
    stopped = error_records(ws)[1]
    assert (stopped["flag"], stopped["what"], stopped["index"]) == (STOPPED, WAIT_COUNTS_FLAG, 2), stopped
    assert error_records(ws)[2]["flag"] == 0
    with pytest.raises(RuntimeError) as raised:
        ws.check_errors()
    lines = str(raised.value).splitlines()
    counter = r"waiting for rank 1's per-expert counts \(count_flags\[1\]\)"
    assert re.match(rf"UniEP forward failed on EP rank 0 .*{counter}.*It failed first", lines[0]), lines[0]
    assert re.match(rf"UniEP forward stopped on EP rank 1 .*count_flags\[2\].*because EP rank 0 failed first .*"
                    rf"{counter}", lines[1]), lines[1]
    assert re.match(rf"UniEP forward stopped on EP rank 2 because EP rank 0 failed first .*{counter}", lines[2]), \
        lines[2]
    assert elapsed < 10, f"{elapsed:.1f} CPU-s: a wait spun towards its bound"


def test_error_copies_keep_the_oldest_copy_in_flight():
    """The lazy check's ring of copies: while earlier copies are still in
    flight (the device is busy, e.g. a kernel spinning for its timeout),
    later calls never discard them, so the first copy after a failure is
    inspected as soon as it lands."""
    from titan_uniep.runtime.workspace import ErrorCopies

    class Event:  # a CUDA event that lands when the test says so
        def __init__(self):
            self.done = False

        def record(self):
            self.done = False

        def query(self):
            return self.done

    copies = ErrorCopies(1, torch.device("cpu"))
    copies.events = [Event() for _ in copies.events]
    control, aborts = torch.zeros(1, 32, dtype=torch.int64), torch.zeros(1, 16, dtype=torch.int64)
    for call in range(7):  # call 1 fails; the host runs six calls ahead
        control[0, CTL_ERROR] = FAILED if call >= 1 else 0
        copies.push(control, aborts)
    assert list(copies.landed()) == []  # nothing has landed yet
    first, second = (copies.events[slot] for slot in list(copies.pending)[:2])
    first.done = True
    assert [c[0, CTL_ERROR].item() for c, _ in copies.landed()] == [0]  # call 0's copy
    second.done = True
    assert [c[0, CTL_ERROR].item() for c, _ in copies.landed()] == [FAILED]  # call 1's, not a later call's
