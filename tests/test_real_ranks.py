"""The binaries a real EP rank launches (one rank per launch, its own arena),
on CPU: ``Workspace.ranks_in_process`` driven phase by phase in Triton's
interpreter, bitwise equal to the simulated world (one launch runs all ranks).

The interpreter runs a launch to its end before the next starts, so a rank's
wait can only be met by launches made before it: every rank publishes its
counts, then every rank collects them; every rank dispatches, then every rank
runs its tiles; and so on (the sequential schedule's phases, rank by rank).
That is the real ranks' code with ``NUM_LOCAL = 1``: each rank's arena a
separate allocation, addressed from its own (peer offsets below and above
it), the COLLECT-only exchange launch of a rank. The one-launch exchange and
the fused grids, where a rank's programs spin on another rank's launch, run
on the GPU (``tests/gpu/test_gpu_real_ranks.py``).
"""

import os

from interpreter_env import request_interpreter

request_interpreter()  # before anything defines a Triton kernel

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from titan_uniep.params import interpreter_params  # noqa: E402
from titan_uniep.runtime import BackwardWorkspace, Workspace, simulated_moe_backward, simulated_moe_forward  # noqa
from titan_uniep.runtime.backward import PHASES as BACKWARD_PHASES, launch_backward  # noqa: E402
from titan_uniep.runtime.forward import PHASES as FORWARD_PHASES, launch_forward  # noqa: E402
from titan_uniep.runtime.launch import CallArrays, route  # noqa: E402

import worlds  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("CPU interpreter tests (GPU: tests/gpu/test_gpu_real_ranks.py)", allow_module_level=True)
if not isinstance(tl.standard.cdiv, InterpretedFunction):
    pytest.skip("Triton was imported before TRITON_INTERPRET=1; run in a subprocess", allow_module_level=True)

DIM, HIDDEN = 32, 48
NAMES = ("out", "dx", "dscores", "dw1", "dw2", "dw3")


def real_ranks(w, params, score_before, seed):
    """Every rank's output and gradients from its own workspaces, phase by phase."""
    world = len(w["xs"])
    capacity = max(max(len(x) for x in w["xs"]), 1)
    sizes = dict(num_tokens=capacity, dim=DIM, hidden=HIDDEN, num_experts=w["el"] * world,
                 top_k=w["indices"][0].shape[1], dtype=torch.float32, device="cpu", params=params)
    fwd = Workspace.ranks_in_process(world, **sizes, seed=seed)
    bwd = BackwardWorkspace.ranks_in_process(world, **sizes, seed=seed + 1)
    for ws in (*fwd, *bwd):
        ws.poison()
    h13 = [torch.full((fwd[0].shape.slot_capacity, 2 * HIDDEN), float("nan")) for _ in range(world)]
    outs = [torch.full((len(x), DIM), float("nan")) for x in w["xs"]]

    def calls(backward):
        u = lambda t: t.contiguous().unsqueeze(0)  # noqa: E731
        return [CallArrays(x=u(w["xs"][r]), scores=u(w["scores"][r]), w1=u(w["w1s"][r]), w2=u(w["w2s"][r]),
                           w3=u(w["w3s"][r]), out=None if backward else outs[r].unsqueeze(0),
                           grad_out=u(w["grads"][r]) if backward else None, h13=h13[r].unsqueeze(0))
                for r in range(world)]

    def routed(spaces):
        for steps in (("count", "publish"), ("collect", "place")):
            for r, ws in enumerate(spaces):
                route(ws, w["indices"][r].unsqueeze(0), len(w["xs"][r]), params, steps=steps)

    routed(fwd)
    forward_calls = calls(backward=False)
    for phase in FORWARD_PHASES["sequential"]:
        for r in range(world):
            launch_forward(fwd[r], forward_calls[r], params, score_before, (phase,))
    routed([b.inner for b in bwd])
    backward_calls = calls(backward=True)
    grads = [{} for _ in range(world)]
    for phase in BACKWARD_PHASES["sequential"]:
        for r in range(world):
            dx, ds, dw1, dw2, dw3 = launch_backward(bwd[r], backward_calls[r], params, score_before, (phase,),
                                                    poison=True)
            if phase == "wgrad":
                grads[r].update(dw1=dw1[0], dw2=dw2[0], dw3=dw3[0])
            elif phase == "reduce":
                grads[r].update(dx=dx[0], dscores=ds[0, :len(w["xs"][r])])
    for ws in (*fwd, *bwd):
        ws.check_errors()
    return [[outs[r], *(grads[r][n] for n in NAMES[1:])] for r in range(world)]


def simulated(w, params, score_before):
    world = len(w["xs"])
    h13 = Workspace.simulated(world, num_tokens=max(max(len(x) for x in w["xs"]), 1), dim=DIM, hidden=HIDDEN,
                              num_experts=w["el"] * world, top_k=w["indices"][0].shape[1], dtype=torch.float32,
                              params=params).shape.slot_capacity
    h13 = torch.full((world, h13, 2 * HIDDEN), float("nan"))
    outs = simulated_moe_forward(w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                                 schedule="sequential", score_before_experts=score_before, params=params,
                                 saved_h13=h13)
    grads = simulated_moe_backward(w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                                   schedule="sequential", score_before_experts=score_before, params=params,
                                   saved_h13=h13)
    return [[outs[r], *grads[r]] for r in range(world)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, tokens, score_before, seed", [
    (2, [13, 9], False, 3),
    (3, [7, 0, 11], True, 5),  # a rank without tokens; scores before the experts
])
def test_real_rank_binaries_give_the_simulated_worlds_bits(world, tokens, score_before, seed):
    w = worlds.make_world(world, 2 * world, 2, tokens, seed=60 + world, dim=DIM, hidden=HIDDEN)
    params = interpreter_params()
    got = real_ranks(w, params, score_before, seed)
    # (whatever the order, the rank whose arena lies highest reaches every peer at a negative offset)
    want = simulated(w, params, score_before)
    for r in range(world):
        for name, a, b in zip(NAMES, got[r], want[r]):
            assert not torch.isnan(a).any(), f"rank {r} {name}: an element was never written"
            assert torch.equal(a, b), f"rank {r} {name}: differs from the simulated world's " \
                f"(max |diff| {(a - b).abs().max():.3g})"


def test_ranks_in_process_workspaces_cannot_grow_one_rank_alone():
    spaces = Workspace.ranks_in_process(2, num_tokens=4, dim=DIM, hidden=HIDDEN, num_experts=4, top_k=2,
                                        dtype=torch.float32, device="cpu", params=interpreter_params())
    assert not spaces[0].is_simulated and spaces[1].rank == 1
    assert not spaces[0].ensure_capacity(4)
    with pytest.raises(ValueError, match="build them again with num_tokens=9"):
        spaces[0].ensure_capacity(9)


def test_real_rank_mode_asks_cuda_for_a_work_queue_per_rank_before_cuda_starts():
    """W rank streams and the default stream on fewer CUDA work queues share one: a
    rank's launch then waits behind another rank's spinning kernel (one H100, W = 8
    with CUDA's default 8 queues). Importing the tool asks for 32; a world that
    does not fit the queues the process has is refused, naming the variable."""
    import subprocess
    import sys

    from titan_uniep.tools import real_ranks

    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    asked = subprocess.run([sys.executable, "-c", "import os, titan_uniep.tools.real_ranks as r; "
                            "print(os.environ['CUDA_DEVICE_MAX_CONNECTIONS'], r.CONNECTIONS)"],
                           env=env, capture_output=True, text=True, check=True).stdout.split()
    assert asked == ["32", "32"]
    old = real_ranks.CONNECTIONS
    try:
        real_ranks.CONNECTIONS = 8
        with pytest.raises(RuntimeError, match="need 9 CUDA work queues.*CUDA_DEVICE_MAX_CONNECTIONS=32"):
            real_ranks.RealRankWorld("after", 8, device="cpu")
    finally:
        real_ranks.CONNECTIONS = old
