"""The check-mode guard on a GPU: comparing never synchronises with the host."""

from stacks import skip_module_unless_torchtitan

skip_module_unless_torchtitan("0.2")  # imports TorchTitan 0.2's API (its edge) below

import logging

import pytest
import torch

from titan_uniep.moe import BitwiseGuard

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("planted", [False, True], ids=["equal", "one_bit_differs"])
def test_check_guard_compare_runs_under_sync_debug_error(planted, caplog):
    guard = BitwiseGuard("check", interval=1)
    guard.steps.start_step(3)
    out = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    again = out.clone()
    if planted:
        again.view(torch.int16)[100, 7] ^= 1
    torch.cuda.synchronize()
    with caplog.at_level(logging.INFO, logger="titan_uniep.moe"):
        torch.cuda.set_sync_debug_mode("error")
        try:
            guard.compare(out, again, "layers.1.moe.experts", None)
            guard.poll()  # logs the verdict if its copy has landed; never waits
        finally:
            torch.cuda.set_sync_debug_mode("default")
        guard.flush()
    assert guard.checks == 1 and guard.mismatches == int(planted)
    messages = [r.getMessage() for r in caplog.records if "UniEP guard" in r.getMessage()]
    expected = "step 3: output differs bitwise" if planted else "step 3: bitwise equal"
    assert len(messages) == 1 and f"layers.1.moe.experts {expected}" in messages[0], messages
