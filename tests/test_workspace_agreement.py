"""Every EP rank builds the same workspace (``runtime.workspace.agree_on_shape``).

A kernel addresses a peer's arena with its own buffer offsets and waits for
as many arrivals as its own tiles send: ranks whose token capacities,
dims or tiles differ would read and write each other's buffers at the
wrong places, or wait for arrivals that never come. ``Workspace.for_group``
agrees on the group's largest token capacity and refuses any other
difference with the values of every rank, before it allocates.
"""

import pytest
import torch
import torch.distributed as dist

from titan_uniep.params import default_params
from titan_uniep.runtime.workspace import WorkspaceShape, agree_on_shape

from distributed import run_distributed


def _shape(rank, **changes):
    fields = dict(world_size=2, token_capacity=100 + 17 * rank, dim=64, hidden=96, num_experts=8, top_k=2,
                  dtype=torch.bfloat16, block_m=128)
    return WorkspaceShape(**{**fields, **changes})


def _agree(rank, world, differ, out):
    params = default_params(world, hidden=96)
    changes = {}
    if differ == "dim":
        changes["dim"] = 64 + 32 * rank
    if differ == "params":
        params = params.replace(fc2_block_n=128 if rank else 256)
    try:
        agreed = agree_on_shape(_shape(rank, **changes), params, dist.group.WORLD)
        result = f"capacity {agreed.token_capacity}"
    except ValueError as err:
        result = str(err)
    torch.save(result, f"{out}/rank{rank}.pt")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("differ", ["nothing", "dim", "params"])
def test_ranks_agree_on_the_largest_capacity_and_refuse_any_other_difference(tmp_path, differ):
    run_distributed(_agree, 2, differ, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    if differ == "nothing":
        assert results == ["capacity 117", "capacity 117"], results
        return
    for text in results:
        assert text.startswith("UniEP workspaces must have the same shape and parameters on every EP rank"), text
    if differ == "dim":
        assert "dim: rank 0 64, rank 1 96" in results[0], results[0]
    else:
        assert "params: rank 0 {'fc2_block_n': 256}, rank 1 {'fc2_block_n': 128}" in results[0], results[0]
    assert "token_capacity" not in results[0]
