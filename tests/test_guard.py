"""The [uniep] guard: recompute a layer and compare bits; strict mode fails on every rank together.

The guard in real training runs (a planted difference named by layer and
step, strict mode stopping both processes) is in test_train_cpu.py.
"""

from __future__ import annotations

import pytest
from torchtitan_release import requires_torchtitan

requires_torchtitan("0.2.2")  # the TorchTitan 0.2.2 edge

import json
import logging
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.models.moe.moe import MoE, MoEArgs

from distributed import run_distributed
from titan_uniep.config import UniEP
from titan_uniep.torchtitan.v0_2.cpu import apply_cpu_tensor_shims
from titan_uniep.torchtitan.layer import BitwiseGuard
from titan_uniep.torchtitan.v0_2.parallelize import UniEPExpertParallel, _swap_to_uniep
from titan_uniep.schedules import register_schedule
from titan_uniep.schedules.reference import reference_schedule


class _Model(torch.nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe(x)


def _flaky_on_rank1(x, routing, w1, w2, w3, *, group, score_before_experts, out_dtype=None):
    """The reference schedule, plus a last-bit change on rank 1 at every other call."""
    out = reference_schedule(x, routing, w1, w2, w3, group=group, score_before_experts=score_before_experts,
                             out_dtype=out_dtype)
    _flaky_on_rank1.calls += 1
    if torch.distributed.get_rank() == 1 and _flaky_on_rank1.calls % 2 == 0:
        out = out.clone()
        out.view(torch.int32)[0, 0] ^= 1
    return out


_flaky_on_rank1.calls = 0


def _guarded_layer(mesh, mode, schedule):
    """Three steps of a guarded layer (checked at steps 1 and 3); its outcome and counts."""
    torch.manual_seed(0)
    moe = MoE(MoEArgs(num_experts=4, num_shared_experts=0, top_k=2), dim=16, hidden_dim=8)
    with torch.no_grad():
        moe.init_weights(init_std=0.1, buffer_device=torch.device("cpu"))
    model = _Model(moe)
    _swap_to_uniep(model, UniEP(enable=True, schedule="reference"))
    moe.experts.schedule = schedule
    parallelize_module(moe.experts, mesh, UniEPExpertParallel())
    guard = BitwiseGuard(mode, interval=2)
    moe.experts.guard = guard
    model.register_forward_pre_hook(guard.steps.count_model_forward)

    torch.manual_seed(torch.distributed.get_rank())
    outcome = "ok"
    try:
        for _ in range(3):  # steps 1, 2, 3: the guard checks steps 1 and 3
            model(torch.randn(1, 5, 16)).sum().backward()
    except RuntimeError as e:
        outcome = str(e)
    guard.flush()
    return {"outcome": outcome, "checks": guard.checks, "mismatches": guard.mismatches}


CASES = (("strict", "reference"), ("strict", "flaky"), ("check", "flaky"))


def _guarded_layers(rank, world, result_dir):
    apply_cpu_tensor_shims()
    register_schedule("flaky", _flaky_on_rank1, needs_cuda=False)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    results = {}
    for mode, schedule in CASES:
        _flaky_on_rank1.calls = 0
        results[f"{mode}/{schedule}"] = _guarded_layer(mesh, mode, schedule)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """Every case of CASES on the same 2 gloo processes: ``results[rank]["mode/schedule"]``."""
    result_dir = tmp_path_factory.mktemp("guard")
    run_distributed(_guarded_layers, 2, str(result_dir))
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(2)]


def test_guard_passes_a_deterministic_schedule(guarded):
    for r in guarded:
        assert r["strict/reference"] == {"outcome": "ok", "checks": 2, "mismatches": 0}


def test_strict_guard_raises_on_every_rank_when_one_rank_differs(guarded):
    for rank, r in enumerate(guarded):
        assert "not bitwise equal" in r["strict/flaky"]["outcome"], f"rank {rank}: {r}"
        assert "layer moe.experts at step 1" in r["strict/flaky"]["outcome"], f"rank {rank}: {r}"
        assert r["strict/flaky"]["checks"] == 1
    assert [r["strict/flaky"]["mismatches"] for r in guarded] == [0, 1]


def test_check_guard_counts_and_continues(guarded):
    results = [r["check/flaky"] for r in guarded]
    assert [r["outcome"] for r in results] == ["ok", "ok"]
    assert [r["checks"] for r in results] == [2, 2]
    assert results[1]["mismatches"] == 2 and results[0]["mismatches"] == 0


# ---------------------------------------------------------------------------
# Check mode does not wait for the device.
# ---------------------------------------------------------------------------

_HOST_SYNCS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), int(), bool(), float() of a tensor
    torch.ops.aten.equal.default,  # torch.equal returns a Python bool
    torch.ops.aten.is_nonzero.default,
}


class _ForbidHostSyncs(TorchDispatchMode):
    """Fails on any op that hands a tensor's value to the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _HOST_SYNCS:
            raise AssertionError(f"{func} reads a tensor's value on the host (a device sync on GPU)")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("planted", [False, True], ids=["equal", "one_bit_differs"])
def test_check_guard_compares_without_reading_values_on_the_host(planted, caplog):
    guard = BitwiseGuard("check", interval=1)
    guard.steps.start_step(7)
    out = torch.randn(6, 16)
    again = out.clone()
    if planted:
        again.view(torch.int32)[2, 3] ^= 1
    with _ForbidHostSyncs():
        guard.compare(out, again, "layers.3.moe.experts", None)
    with caplog.at_level(logging.INFO, logger="titan_uniep.torchtitan.layer"):
        guard.poll()  # the next step's first forward: the verdict is logged here
    assert guard.checks == 1 and guard.mismatches == int(planted)
    [record] = [r for r in caplog.records if "UniEP guard" in r.getMessage()]
    if planted:
        assert record.levelno == logging.WARNING
        assert "layer layers.3.moe.experts step 7: output differs bitwise" in record.getMessage()
        assert "in 1 of 96 elements" in record.getMessage()
    else:
        assert record.levelno == logging.INFO and "layers.3.moe.experts step 7: bitwise equal" in record.getMessage()
