"""UniEP forward kernels in bf16 on ONE GPU, with a simulated world of W ranks
(every rank's buffers in this process, one launch per phase for the world).

Run on the GPU machine: ``python -m pytest tests/gpu/test_gpu_simulated.py``.
"""

import pytest
import torch

from titan_uniep.oracle import float64_moe_oracle, layout_oracle_forward
from titan_uniep.params import LayerParams
from titan_uniep.runtime import Workspace

import worlds

pytestmark = pytest.mark.gpu

DIM, HIDDEN = 256, 384


def make_world(world, num_experts, top_k, num_tokens, *, seed, allowed=None, force=None, dtype=torch.bfloat16):
    """Random inputs of a simulated world on the GPU (``worlds.make_world`` at this file's dims)."""
    return worlds.make_world(world, num_experts, top_k, num_tokens, seed=seed, dim=DIM, hidden=HIDDEN,
                             allowed=allowed, force=force, device="cuda", dtype=dtype)


def check_world(w, *, score_before, params=None, workspace=None):
    """Sequential and fused into NaN-poisoned stacked outputs (written in place
    by the kernels, one row more than the longest rank): bitwise equal, every
    row of a rank written, rows past it untouched, close to float64 and to the
    layout reference."""
    sequential, fused = worlds.run_both_poisoned(w, score_before=score_before, params=params, workspace=workspace)
    layout_ref = layout_oracle_forward(
        w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], score_before_experts=score_before
    )
    for r, (seq, fus) in enumerate(zip(sequential, fused)):
        assert torch.equal(seq, fus), f"rank {r}: fused differs from sequential"
        assert not torch.isnan(fus).any(), f"rank {r}: NaN in output"
        if fus.shape[0] == 0:
            continue
        exact = float64_moe_oracle(w["xs"][r], w["scores"][r], w["indices"][r], w["w1"], w["w2"], w["w3"],
                                      score_before_experts=score_before)
        scale = exact.abs().max().item()
        torch.testing.assert_close(fus.double(), exact, rtol=3e-2, atol=3e-2 * scale)
        torch.testing.assert_close(fus.float(), layout_ref[r].float(), rtol=2e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("fc2", [{}, dict(fc2_defer_release=True), dict(fc2_flat_loop=True)],
                         ids=["claims", "deferred_release", "flat_loop"])
@pytest.mark.parametrize("score_before", [False, True], ids=["score_after", "score_before"])
@pytest.mark.parametrize("world,num_experts,top_k,num_tokens", [
    (2, 16, 4, [700, 513]),
    (4, 16, 4, [300, 129, 0, 257]),
    (8, 32, 8, [300, 129, 0, 257, 1, 64, 200, 77]),  # EP = 8 of one node, top-8 (ranks with 0 and 1 tokens)
])
def test_simulated_world_bf16(world, num_experts, top_k, num_tokens, score_before, fc2):
    w = make_world(world, num_experts, top_k, num_tokens, seed=world + 10 * score_before)
    params = LayerParams(**fc2)
    ws = Workspace.simulated(world, num_tokens=max(num_tokens), dim=DIM, hidden=HIDDEN, num_experts=num_experts,
                             top_k=top_k, dtype=torch.bfloat16, device="cuda", params=params)
    for _ in range(2):  # the second call reuses the workspace (epochs, zeroed counters)
        check_world(w, score_before=score_before, workspace=ws, params=params)


@pytest.mark.parametrize("case", ["skewed", "rank_receives_nothing", "one_local_expert", "small_tiles"])
def test_simulated_world_bf16_edge_routing(case):
    params = None
    if case == "skewed":
        w = make_world(2, 16, 4, [600, 400], seed=3, force=7)
    elif case == "rank_receives_nothing":
        w = make_world(2, 16, 4, [300, 200], seed=4, allowed=list(range(8)))
    elif case == "one_local_expert":
        w = make_world(2, 2, 2, [333, 100], seed=5)
    else:  # BM=64, odd comm blocks, few programs: another point of the schedule space, same results
        w = make_world(2, 16, 4, [500, 301], seed=6)
        params = LayerParams(dispatch_programs=3, num_programs=20, block_m=64,
                             fc1_block_n=64, fc2_block_n=128, dispatch_block_tokens=8, reduce_block_tokens=8)
    check_world(w, score_before=case == "one_local_expert", params=params)


@pytest.mark.parametrize("change", [dict(group_m=1), dict(dispatch_block_tokens=32), dict(fc1_num_stages=4)],
                         ids=["group_m_1", "dispatch_block_tokens_32", "fc1_stages_4"])
def test_score_before_fc1_gives_the_default_points_bits_on_every_call(change):
    """Scores before the experts, a 576 x 744 layer (W = 2, one rank without
    tokens): points whose ``dispatch_fc1`` compiles to other code gave
    another output on every call while fc1 was pipelined (off by up to 0.18
    against float64, the default point 0.019; ``kernels.dispatch_fc1.
    fc1_launch_stages``). Six calls of each schedule, each on freshly
    poisoned buffers, equal the default point's output bit for bit."""
    from titan_uniep.params import default_params

    w = worlds.make_world(2, 10, 4, [257, 0], seed=303, dim=576, hidden=744, device="cuda", dtype=torch.bfloat16)
    base = default_params(2, hidden=744)
    reference = worlds.run_both_poisoned(w, score_before=True, params=base)[0][0]
    exact = float64_moe_oracle(w["xs"][0], w["scores"][0], w["indices"][0], w["w1"], w["w2"], w["w3"],
                               score_before_experts=True)
    scale = exact.abs().max().item()
    torch.testing.assert_close(reference.double(), exact, rtol=3e-2, atol=3e-2 * scale)
    point = base.replace(**change)
    for call in range(3):
        sequential, fused = worlds.run_both_poisoned(w, score_before=True, params=point)
        for schedule, out in (("sequential", sequential[0]), ("fused", fused[0])):
            assert torch.equal(out, reference), (
                f"{change}, call {call + 1}, {schedule}: output differs from the default point's in "
                f"{int((out != reference).sum())} elements, max |diff| {(out.float() - reference.float()).abs().max():.3g}")
