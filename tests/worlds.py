"""Random inputs of a simulated EP world and the poisoned run of both forward
schedules: shared by the interpreter tests (``tests/``, fp32 on CPU) and the
one-GPU tests (``tests/gpu/``, bf16 on CUDA)."""

import torch

from titan_uniep.runtime import simulated_moe_forward


def make_world(world, num_experts, top_k, num_tokens, *, seed, dim, hidden, allowed=None, force=None,
               device="cpu", dtype=torch.float32):
    """Seeded inputs of a ``world``-rank simulated world with ``num_tokens[r]``
    tokens on rank ``r``: per rank ``xs``, ``grads`` (output gradients),
    router ``scores`` and ``indices`` (``top_k`` distinct experts of
    ``allowed``, default all; ``force``: an expert every token picks, for
    skewed routing), the whole ``w1``/``w2``/``w3`` and each rank's local
    ``w1s``/``w2s``/``w3s`` (``el`` experts each)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    el = num_experts // world

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    w1 = randn(num_experts, hidden, dim, scale=dim**-0.5)
    w3 = randn(num_experts, hidden, dim, scale=dim**-0.5)
    w2 = randn(num_experts, dim, hidden, scale=hidden**-0.5)
    allowed = torch.arange(num_experts, device=device) if allowed is None else torch.tensor(allowed, device=device)
    xs, grads, scores, indices = [], [], [], []
    for t in num_tokens:
        xs.append(randn(t, dim))
        grads.append(randn(t, dim))
        scores.append(torch.rand(t, top_k, generator=gen, device=device))
        picked = allowed[torch.rand(t, len(allowed), generator=gen, device=device).argsort(1)][:, :top_k]
        if force is not None:  # replace the last pick of tokens that lack ``force``
            lacks = (picked != force).all(1)
            picked[lacks, -1] = force
        indices.append(picked.contiguous())
    local = lambda w: [w[r * el:(r + 1) * el].contiguous() for r in range(world)]  # noqa: E731
    return dict(xs=xs, grads=grads, scores=scores, indices=indices, w1=w1, w2=w2, w3=w3,
                w1s=local(w1), w2s=local(w2), w3s=local(w3), el=el)


def run_both_poisoned(w, *, score_before, params, workspace=None):
    """Both forward schedules on poisoned buffers: the workspace's
    (``poison``) and a NaN-filled stacked output one row longer than the
    longest rank, which the kernels write in place. Asserts that each rank's
    output is the view ``out[r, :T_r]``, that every row of it was written and
    that no row past it was; returns (sequential, fused)."""
    num_tokens = [x.shape[0] for x in w["xs"]]
    dim, x0 = w["xs"][0].shape[1], w["xs"][0]
    outs = {}
    for schedule in ("sequential", "fused"):
        if workspace is not None:
            workspace.poison()
        poisoned = torch.full((len(num_tokens), max(num_tokens) + 1, dim), float("nan"), dtype=x0.dtype,
                              device=x0.device)
        outs[schedule] = simulated_moe_forward(
            w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule=schedule,
            score_before_experts=score_before, params=params, workspace=workspace, out=poisoned,
        )
        for r, t in enumerate(num_tokens):
            view = outs[schedule][r]
            assert (view.untyped_storage().data_ptr() == poisoned.untyped_storage().data_ptr()
                    and view.storage_offset() == poisoned[r].storage_offset() and view.shape == (t, dim)), \
                f"{schedule} rank {r}: the output is not the view out[r, :T_r]"
            assert not torch.isnan(poisoned[r, :t]).any(), f"{schedule} rank {r}: a row of out was never written"
            assert torch.isnan(poisoned[r, t:]).all(), f"{schedule} rank {r}: a row past T_r was written"
    return outs["sequential"], outs["fused"]
