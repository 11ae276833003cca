"""The [uniep] guard: recompute a layer and compare bits; strict mode fails on every rank together."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.models.moe.moe import MoE, MoEArgs

from distributed import run_distributed
from titan_uniep.config import UniEP
from titan_uniep.cpu import apply_cpu_shims
from titan_uniep.moe import BitwiseGuard
from titan_uniep.parallelize import UniEPExpertParallel, _swap_to_uniep
from titan_uniep.schedules import register_schedule
from titan_uniep.schedules.reference import reference_schedule


class _Model(torch.nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe(x)


def _flaky_on_rank1(x, routing, w1, w2, w3, *, group, score_before_experts):
    """The reference schedule, plus a last-bit change on rank 1 at every other call."""
    out = reference_schedule(x, routing, w1, w2, w3, group=group, score_before_experts=score_before_experts)
    _flaky_on_rank1.calls += 1
    if torch.distributed.get_rank() == 1 and _flaky_on_rank1.calls % 2 == 0:
        out = out.clone()
        out.view(torch.int32)[0, 0] ^= 1
    return out


_flaky_on_rank1.calls = 0


def _guarded_layer(rank, world, mode, schedule, result_dir):
    apply_cpu_shims()
    register_schedule("flaky", _flaky_on_rank1, needs_cuda=False)
    torch.manual_seed(0)
    moe = MoE(MoEArgs(num_experts=4, num_shared_experts=0, top_k=2), dim=16, hidden_dim=8)
    with torch.no_grad():
        moe.init_weights(init_std=0.1, buffer_device=torch.device("cpu"))
    model = _Model(moe)
    _swap_to_uniep(model, UniEP(enable=True, schedule="reference"))
    moe.experts.schedule = schedule
    parallelize_module(moe.experts, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)), UniEPExpertParallel())
    guard = BitwiseGuard(mode, interval=2)
    moe.experts.guard = guard
    model.register_forward_pre_hook(guard.count_model_forward)

    torch.manual_seed(rank)
    outcome = "ok"
    try:
        for _ in range(3):  # steps 1, 2, 3: the guard checks steps 1 and 3
            model(torch.randn(1, 5, 16)).sum().backward()
    except RuntimeError as e:
        outcome = str(e)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"outcome": outcome, "checks": guard.checks, "mismatches": guard.mismatches}, f)


def _run(tmp_path, mode, schedule):
    run_distributed(_guarded_layer, 2, mode, schedule, str(tmp_path))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_guard_passes_a_deterministic_schedule(tmp_path):
    results = _run(tmp_path, "strict", "reference")
    for r in results:
        assert r == {"outcome": "ok", "checks": 2, "mismatches": 0}


def test_strict_guard_raises_on_every_rank_when_one_rank_differs(tmp_path):
    results = _run(tmp_path, "strict", "flaky")
    for rank, r in enumerate(results):
        assert "not bitwise equal" in r["outcome"], f"rank {rank}: {r}"
        assert r["checks"] == 1
    assert [r["mismatches"] for r in results] == [0, 1]


def test_check_guard_counts_and_continues(tmp_path):
    results = _run(tmp_path, "check", "flaky")
    assert [r["outcome"] for r in results] == ["ok", "ok"]
    assert [r["checks"] for r in results] == [2, 2]
    assert results[1]["mismatches"] >= 1 and results[0]["mismatches"] == 0
