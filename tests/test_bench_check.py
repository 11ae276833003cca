"""The benchmarks' --check on CPU: the statistics it asserts, the exit status
beyond the limits (an injected difference must fail it), the float64
backward oracle it compares gradients with, and the --report files."""

from __future__ import annotations

import functools

import pytest
import torch

from titan_uniep.accuracy import LIMITS, enforce, failures, rel_diff
from titan_uniep.tools.bench import forward_stats
from titan_uniep.oracle import float64_moe_backward_oracle, float64_moe_oracle, layout_oracle_forward
from titan_uniep.tools.report import write_report

BF16 = LIMITS["forward"]["bf16"]


def _layer(seed=0, tokens=37, dim=64, hidden=48, experts=6, top_k=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen).to(torch.bfloat16)
    w1 = (torch.randn(experts, hidden, dim, generator=gen) * dim**-0.5).to(torch.bfloat16)
    w3 = (torch.randn(experts, hidden, dim, generator=gen) * dim**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, dim, hidden, generator=gen) * hidden**-0.5).to(torch.bfloat16)
    scores, indices = torch.softmax(torch.randn(tokens, experts, generator=gen), 1).topk(top_k, dim=1)
    return x, scores, indices, w1, w2, w3


@functools.cache
def _forward_outputs(score_before=False):
    """A bf16 pipeline that rounds where the kernels round (the layout oracle),
    and float64 (computed once per score mode: callers clone before changing)."""
    x, scores, indices, w1, w2, w3 = _layer()
    out = layout_oracle_forward([x], [scores], [indices], [w1], [w2], [w3], score_before_experts=score_before)[0]
    exact = float64_moe_oracle(x[:16], scores[:16], indices[:16], w1, w2, w3, score_before_experts=score_before)
    return out, exact


def _record(stats, limit=BF16):
    return {"shape": "layer", "check": stats, "check_failures": failures(stats, limit)}


def test_forward_check_passes_a_kernel_like_bf16_output():
    out, exact = _forward_outputs()
    titan = out.clone()
    stats = forward_stats(out.clone(), out, titan, exact, tuned=out.clone())
    assert stats["out_fused_vs_sequential_bitwise_diff"] == 0 and 0 < stats["out_vs_float64"] < BF16["vs_float64"]
    assert failures(stats, BF16) == []
    enforce([_record(stats)])  # no exit


@pytest.mark.parametrize("inject,message", [
    ("one_ulp", "out_fused_vs_sequential: not bitwise equal"),
    ("tuned_one_ulp", "out_tuned_vs_default: not bitwise equal"),
    ("far_from_float64", "out_vs_float64: "),
    ("far_from_titan", "out_vs_titan: "),
    ("nan", "out_vs_float64: inf exceeds"),
])
def test_forward_check_exits_nonzero_on_an_injected_difference(inject, message, capsys):
    out, exact = _forward_outputs(score_before=True)
    sequential, fused, titan, tuned = out.clone(), out.clone(), out.clone(), out.clone()
    scale = out.float().abs().max()
    if inject == "one_ulp":
        fused.view(torch.int16)[5, 7] += 1  # the next bf16 value
    elif inject == "tuned_one_ulp":
        tuned.view(torch.int16)[3, 1] += 1
    elif inject == "far_from_float64":
        fused[2] += (0.1 * scale).to(fused.dtype)
        sequential, titan = fused.clone(), fused.clone()
    elif inject == "far_from_titan":
        titan[20] -= (0.2 * scale).to(titan.dtype)
    elif inject == "nan":
        fused[0, 0] = float("nan")
        sequential = fused.clone()
    stats = forward_stats(sequential, fused, titan, exact, tuned=tuned)
    record = _record(stats)
    assert any(message in m for m in record["check_failures"]), record["check_failures"]
    with pytest.raises(SystemExit) as exit_info:
        enforce([_record(forward_stats(out, out, out, exact)), record])
    assert exit_info.value.code == 1
    assert f"CHECK FAILED layer: {message}" in capsys.readouterr().out


def test_error_worse_than_torchtitans_fails_even_within_the_limit():
    stats = {"out_vs_float64": 0.02, "out_titan_vs_float64": 0.005}  # both below 0.03; 0.02 > 1.5 x 0.005 + 0.003
    assert failures(stats, BF16) == [
        "out: error vs float64 0.02 exceeds 1.5 x TorchTitan's 0.005 + 0.003"]
    assert failures({"out_vs_float64": 0.011, "out_titan_vs_float64": 0.008}, BF16) == []
    assert failures({"what_is_this": 0.0}, BF16) == ["what_is_this: no threshold for this statistic"]


def test_backward_statistics_fail_on_an_injected_gradient_difference():
    limit = LIMITS["backward"]["bf16"]
    x, scores, indices, w1, w2, w3 = (t.double() if t.is_floating_point() else t for t in _layer(seed=3))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    exact = float64_moe_backward_oracle(x, scores, indices, grad, w1, w2, w3, score_before_experts=False)
    ours = [g.to(torch.bfloat16) if i != 1 else g.float() for i, g in enumerate(exact)]
    stats = {f"{n}_vs_float64": rel_diff(a, b) for n, a, b in zip(("dx", "dscores", "dw1", "dw2", "dw3"), ours,
                                                                   exact)}
    stats["grads_fused_vs_sequential_bitwise_diff"] = 0.0
    assert failures(stats, limit) == []
    ours[3][1, 2, 3] += 0.5 * exact[3].abs().max().item()
    stats["dw2_vs_float64"] = rel_diff(ours[3], exact[3])
    assert failures(stats, limit) == [f"dw2_vs_float64: {stats['dw2_vs_float64']:.3g} exceeds the limit 0.03"]


@pytest.mark.parametrize("score_before", [False, True])
def test_float64_backward_oracle_equals_autograd(score_before):
    gen = torch.Generator().manual_seed(7)
    tokens, dim, hidden, experts, top_k = 11, 8, 6, 5, 3
    x = torch.randn(tokens, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    picked = torch.rand(tokens, experts, generator=gen).softmax(1).topk(top_k, dim=1)
    scores = picked.values.double().requires_grad_()
    weights = [torch.randn(experts, *s, generator=gen, dtype=torch.float64, requires_grad=True)
               for s in ((hidden, dim), (dim, hidden), (hidden, dim))]
    grad = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    out = float64_moe_oracle(x, scores, picked.indices, *weights, score_before_experts=score_before)
    want = torch.autograd.grad(out, [x, scores, *weights], grad)
    got = float64_moe_backward_oracle(x.detach(), scores.detach(), picked.indices, grad,
                                      *(w.detach() for w in weights), score_before_experts=score_before)
    for name, a, b in zip(("dx", "dscores", "dw1", "dw2", "dw3"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    some = [4, 1]
    sub = float64_moe_backward_oracle(x.detach(), scores.detach(), picked.indices, grad,
                                      *(w.detach() for w in weights), score_before_experts=score_before,
                                      experts=some)
    for a, b in zip(sub[2:], want[2:]):
        torch.testing.assert_close(a, b[some], rtol=1e-12, atol=1e-12)
    dx_only = float64_moe_backward_oracle(x.detach(), scores.detach(), picked.indices, grad,
                                          *(w.detach() for w in weights), score_before_experts=score_before,
                                          weight_grads=False)
    assert dx_only[2:] == (None, None, None) and torch.equal(dx_only[0], got[0])


def _bench_record(name, world=1):
    stages = {"forward": {"exchange": 0.02, "dispatch": 0.1, "fc1": 0.5, "fc2": 0.3, "combine": 0.0, "reduce": 0.05},
              "backward": {"dh": 0.9, "da": 0.6, "wgrad": 0.8}}
    model = {"hardware": "uncalibrated: test", "default": {**stages, "forward_total": 0.9, "backward_total": 2.2},
             "tuned": {**stages, "forward_total": 0.8, "backward_total": 2.1}}
    return {"shape": name, "tokens": 4096, "dim": 2048, "hidden": 768, "experts": 128, "top_k": 8, "world": world,
            "gpu": "NVIDIA H200", "dtype": "bf16", "titan_ep_ms": 2.5, "uniep_fused_ms": 1.2,
            "uniep_sequential_ms": 1.4, "uniep_tuned_ms": 1.1, "gemm_only_ms": 0.9, "transfer_only_ms": 0.003,
            "model": model, "tuned": {"forward": {"applied": True, "reason": "tuned 2026-12-01"}}}


def test_report_writes_markdown_and_one_plot_per_shape(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_report(tmp_path / "report", [_bench_record("qwen3_1gpu"), _bench_record("odd/dim", world=2)],
                         "forward")
    md = (tmp_path / "report" / "forward.md").read_text()
    assert [p.name for p in paths] == ["forward.md", "forward_qwen3_1gpu.png", "forward_odd_dim.png"]
    for path in paths[1:]:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    header = next(line for line in md.splitlines() if line.startswith("| shape |"))
    for column in ("TorchTitan EP", "UniEP default (fused)", "UniEP tuned (fused)", "GEMM-only", "model: UniEP default",
                   "model: UniEP tuned"):
        assert column in header
    assert "transfer-only" not in header, "a one-rank first record: transfer-only is a multi-rank bound"
    assert "| qwen3_1gpu | 4096 | 2048 | 768 | 128 | 8 | 2.500 | 1.200 | 1.400 | 1.100 | 0.900 | 0.900 | 0.800 |" in md
    assert "| forward.fc1 | 0.500 | 0.500 |" in md and "tuned forward point applied: tuned 2026-12-01" in md
    assert "![qwen3_1gpu](forward_qwen3_1gpu.png)" in md
