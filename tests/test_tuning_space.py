"""The tuning space's bitwise contract on the real kernels (CPU, Triton interpreter).

Random schedule points (``tuning.space.sample``) give the default point's
bits in every output and gradient: simulated worlds W = 1, 2, 4 (W = 4 with
skewed routing and a rank without tokens), both score modes (``CASES``), forward output and the used
h1 | h3 rows, dx, dscores, dw1, dw2, dw3 of the backward on the saved
h1 | h3. An opt-in numerics point changes bits and
stays within the float64 reference's tolerance; a weight-gradient K step
changes its gradients' bits (W = 1 has more rows per expert than the
smallest K step, which the weight gradients' K steps split).

The interpreter's ``tl.dot`` is numpy's matmul, whose rounding depends on
the matrices' shapes (BLAS kernels): ``tests/interpreter_dot.py`` makes it
sum each element in k order, as a GPU's MMA chain does whatever the tile
width; GPU runs: ``scripts/check_schedule_bits.py --device cuda``.

Seeds: ``SEED`` plus ``UNIEP_TUNING_SEED`` (default 0; set it to explore
other points); a failure names the seed and the fields that differ.
"""

import os

from interpreter_env import request_interpreter

request_interpreter()  # before anything defines a Triton kernel

import random  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from titan_uniep.oracle import float64_moe_oracle  # noqa: E402
from titan_uniep.params import interpreter_params  # noqa: E402
from titan_uniep.runtime import simulated_moe_backward, simulated_moe_forward  # noqa: E402
from titan_uniep.tuning.space import FIELDS, LayerShape, keeps_bits, sample  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from interpreter_dot import shape_independent_dot  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("CPU interpreter tests (GPU: scripts/check_schedule_bits.py --device cuda)", allow_module_level=True)
if not isinstance(tl.standard.cdiv, InterpretedFunction):
    pytest.skip("Triton was imported before TRITON_INTERPRET=1; run in a subprocess", allow_module_level=True)

SEED = 20261201 + int(os.environ.get("UNIEP_TUNING_SEED", "0"))
DIM, HIDDEN = 32, 24  # H = 24: a masked column block at 16-wide tiles
# W = 1 has 17 to 19 rows per expert: the weight gradients' K steps run over an expert's rows, and
# only rows beyond the smallest K step (16) are split differently by another K step.
WORLDS = {1: dict(E=4, K=3, T=[24]), 2: dict(E=4, K=3, T=[4, 3]), 4: dict(E=4, K=2, T=[3, 0, 3, 2])}
# The interpreter's tiles, 32 wide where the cost is in the number of programs (the K steps stay 16:
# two K steps over D = 32); samples draw 16- and 32-wide tiles.
BASE = interpreter_params(fc1_block_n=32, fc2_block_n=32, dh_block_n=32, da_block_n=32, wgrad_w13_block_m=32,
                          wgrad_w13_block_n=32, wgrad_w2_block_m=32, wgrad_w2_block_n=32)
# (world, scores before the experts): every world and both score modes, within the CPU budget
CASES = ((1, False), (2, False), (2, True), (4, True))
NAMES = ("dx", "dscores", "dw1", "dw2", "dw3")


@pytest.fixture(autouse=True)
def _ordered_dot():
    with shape_independent_dot():
        yield


def world_inputs(world: int) -> dict:
    """Fresh random inputs of one simulated world (the same for every point)."""
    spec = WORLDS[world]
    gen = torch.Generator().manual_seed(1000 + world)
    num_experts, top_k = spec["E"], spec["K"]
    el = num_experts // world
    w1 = torch.randn(num_experts, HIDDEN, DIM, generator=gen) / DIM**0.5
    w3 = torch.randn(num_experts, HIDDEN, DIM, generator=gen) / DIM**0.5
    w2 = torch.randn(num_experts, DIM, HIDDEN, generator=gen) / HIDDEN**0.5
    xs, grads, scores, indices = [], [], [], []
    for t in spec["T"]:
        xs.append(torch.randn(t, DIM, generator=gen))
        grads.append(torch.randn(t, DIM, generator=gen))
        scores.append(0.05 + 0.9 * torch.rand(t, top_k, generator=gen))
        if world == 4:  # skewed: every token takes expert 0 (rank 0), then a random other
            others = 1 + torch.rand(t, num_experts - 1, generator=gen).argsort(1)[:, : top_k - 1]
            picked = torch.cat([torch.zeros(t, 1, dtype=torch.int64), others], 1)
        else:
            picked = torch.rand(t, num_experts, generator=gen).argsort(1)[:, :top_k]
        indices.append(picked.contiguous())
    local = lambda w: [w[r * el:(r + 1) * el].contiguous() for r in range(world)]  # noqa: E731
    used = [int(sum(int((idx // el == r).sum()) for idx in indices)) for r in range(world)]
    return dict(xs=xs, grads=grads, scores=scores, indices=indices, w1=w1, w2=w2, w3=w3, w1s=local(w1),
                w2s=local(w2), w3s=local(w3), used=used, shape=LayerShape(max(spec["T"]), DIM, HIDDEN, num_experts,
                                                                           top_k, world, 4))


def run_point(world: int, params, score_before: bool, schedule: str) -> dict[str, torch.Tensor]:
    """Every output of one point: the forward into NaN-poisoned buffers, then the backward."""
    i = world_inputs(world)
    rows = max(max(len(x) for x in i["xs"]), 1)
    out = torch.full((world, rows + 1, DIM), float("nan"))
    from titan_uniep.layout import slot_capacity

    slots = slot_capacity(world, rows, i["indices"][0].shape[1], len(i["w1s"][0]))
    h13 = torch.full((world, slots, 2 * HIDDEN), float("nan"))
    outs = simulated_moe_forward(i["xs"], i["scores"], i["indices"], i["w1s"], i["w2s"], i["w3s"], schedule=schedule,
                                 score_before_experts=score_before, params=params, out=out, saved_h13=h13)
    result = {}
    for r in range(world):
        result[f"fwd.out.r{r}"] = outs[r].clone()
        result[f"fwd.h13.r{r}"] = h13[r, : i["used"][r]].clone()
        assert torch.isnan(out[r, len(i["xs"][r]):]).all(), f"rank {r}: rows past its tokens were written"
    grads = simulated_moe_backward(i["grads"], i["xs"], i["scores"], i["indices"], i["w1s"], i["w2s"], i["w3s"],
                                   schedule=schedule, score_before_experts=score_before, params=params,
                                   poison_outputs=True, saved_h13=h13)
    for r in range(world):
        for name, g in zip(NAMES, grads[r]):
            result[f"bwd.{name}.r{r}"] = g.clone()
    for name, t in result.items():
        assert not torch.isnan(t).any(), f"{name}: NaN (read before written)"
    return result


_references: dict[tuple[int, bool], dict[str, torch.Tensor]] = {}


def reference(world: int, score_before: bool) -> dict[str, torch.Tensor]:
    """The default point's outputs (sequential schedule), once per world and score mode."""
    key = (world, score_before)
    if key not in _references:
        _references[key] = run_point(world, BASE, score_before, "sequential")
    return _references[key]


@pytest.mark.parametrize("world, score_before", CASES)
def test_random_schedule_points_give_the_default_points_bits(world, score_before):
    shape = world_inputs(world)["shape"]
    seed = SEED + 10 * world + int(score_before)
    rng = random.Random(seed)
    point = sample(rng, shape, base=BASE)
    schedule = rng.choice(("sequential", "fused"))
    changed = {f: getattr(point, f) for f in FIELDS if getattr(point, f) != getattr(BASE, f)}
    assert keeps_bits(point, BASE) is None, f"seed {seed}: sample() changed a numerics field: {changed}"
    assert changed, f"seed {seed}: the sample is the default point"
    where = f"seed {seed}, W={world}, scores {'before' if score_before else 'after'}, {schedule}, {changed}"
    print(where)
    ref, got = reference(world, score_before), run_point(world, point, score_before, schedule)
    assert got.keys() == ref.keys()
    differ = [name for name in ref if not torch.equal(got[name], ref[name])]
    assert not differ, f"{where}: bits differ in {differ}"


@pytest.mark.parametrize("score_before", [False, True], ids=["score_after", "score_before"])
def test_one_product_fc1_tile_gives_the_two_product_tiles_bits(score_before):
    """``fc1_one_dot`` (interleaved w1 | w3 columns in one product, the GPU
    default) on a masked column block (H = 24 at 32-wide tiles), the fused
    schedule: every output and gradient equal to the two-product default's."""
    point = BASE.replace(fc1_one_dot=True)
    assert keeps_bits(point, BASE) is None
    ref, got = reference(2, score_before), run_point(2, point, score_before, "fused")
    differ = [name for name in ref if not torch.equal(got[name], ref[name])]
    assert not differ, f"fc1_one_dot: bits differ in {differ}"


def float64_reference(world: int, score_before: bool) -> dict[str, torch.Tensor]:
    """Forward outputs and every gradient by float64 autograd of the oracle."""
    i = world_inputs(world)
    weights = [w.double().requires_grad_() for w in (i["w1"], i["w2"], i["w3"])]
    result = {}
    for r in range(world):
        x = i["xs"][r].double().requires_grad_()
        s = i["scores"][r].double().requires_grad_()
        out = float64_moe_oracle(x, s, i["indices"][r], *weights, score_before_experts=score_before)
        result[f"fwd.out.r{r}"] = out.detach()
        dx, ds = torch.autograd.grad(out, (x, s), i["grads"][r].double(), retain_graph=True)
        result[f"dx.r{r}"], result[f"dscores.r{r}"] = dx, ds
        (out * i["grads"][r].double()).sum().backward()
    el = len(i["w1s"][0])
    for r in range(world):
        for name, w in zip(("dw1", "dw2", "dw3"), weights):
            result[f"{name}.r{r}"] = w.grad[r * el:(r + 1) * el]
    return result


def test_opt_in_numerics_point_changes_bits_within_the_float64_tolerance():
    world, score_before = 2, False
    point = BASE.replace(fc1_block_k=32, da_block_k=32)  # D = 32: fc1 in one K step instead of two
    assert keeps_bits(point, BASE) == "fc1_block_k"
    ref, got = reference(world, score_before), run_point(world, point, score_before, "fused")
    changed = [name for name in ref if not torch.equal(got[name], ref[name])]
    assert any(n.startswith("fwd.out") for n in changed) and any(n.startswith("bwd.dx") for n in changed), changed
    exact = float64_reference(world, score_before)
    for r in range(world):
        pairs = [("fwd.out", "fwd.out")] + [(f"bwd.{n}", n) for n in NAMES]
        for ours, theirs in pairs:
            torch.testing.assert_close(got[f"{ours}.r{r}"].double(), exact[f"{theirs}.r{r}"], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, o=ours: f"rank {r} {o} vs float64: {m}")


@pytest.mark.parametrize("field, changed", [("wgrad_w13_block_k", {"dw1", "dw3"}), ("wgrad_w2_block_k", {"dw2"})],
                         ids=["w13", "w2"])
def test_weight_gradient_k_step_changes_the_bits_of_its_gradients(field, changed):
    """The weight gradients sum over an expert's rows in K steps: at 32 rows a
    step instead of 16, an expert of 17 to 19 rows adds its last rows in
    another order, so the field is numerics (``keeps_bits`` names it, the
    search leaves it alone) and exactly its gradients change."""
    point = BASE.replace(**{field: 32})
    assert keeps_bits(point, BASE) == field
    ref, got = reference(1, False), run_point(1, point, False, "sequential")
    differ = {name.split(".")[1] for name in ref if not torch.equal(got[name], ref[name])}
    assert differ == changed, f"{field} = 32 changed {sorted(differ)}"


def test_sample_keeps_numerics_fields_unless_opted_in():
    shape = world_inputs(2)["shape"]
    rng = random.Random(SEED)
    plain = [sample(rng, shape, base=BASE) for _ in range(40)]
    assert all(keeps_bits(p, BASE) is None for p in plain)
    opted = [sample(rng, shape, base=BASE, numerics=True) for _ in range(40)]
    assert any(keeps_bits(p, BASE) is not None for p in opted)
