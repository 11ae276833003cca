"""The testing-only UNIEP_TEST_* hooks (titan_uniep.testing): parsing and what each one changes."""

import pytest
import torch

from titan_uniep.testing import ENV_GUARD_FLIP, ENV_ONE_EXPERT_STEP, ENV_RECORD_DIR, UniEPTestHooks


def test_no_variable_means_no_hooks():
    assert UniEPTestHooks.from_env({"UNIEP_OTHER": "1"}) is None


def test_variables_are_parsed():
    hooks = UniEPTestHooks.from_env({ENV_ONE_EXPERT_STEP: "2", ENV_RECORD_DIR: "/tmp/r", ENV_GUARD_FLIP: "3:1"})
    assert hooks == UniEPTestHooks(one_expert_step=2, record_dir="/tmp/r", guard_flip_step=3, guard_flip_rank=1)


@pytest.mark.parametrize("env,match", [
    ({ENV_GUARD_FLIP: "3"}, "UNIEP_TEST_GUARD_FLIP='3': expected STEP:EP_RANK"),
    ({ENV_GUARD_FLIP: "0:1"}, "UNIEP_TEST_GUARD_FLIP='0'"),
    ({ENV_ONE_EXPERT_STEP: "two"}, "UNIEP_TEST_ONE_EXPERT_STEP='two': expected a training step"),
    ({ENV_RECORD_DIR: "/tmp/r"}, "set both"),
])
def test_bad_values_name_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        UniEPTestHooks.from_env(env)


def test_one_expert_step_routes_every_token_to_experts_0_to_k_minus_1_at_that_step_only():
    hooks = UniEPTestHooks(one_expert_step=2)
    indices = torch.randint(0, 8, (7, 3))
    counts = torch.histc(indices.float(), bins=8, min=0, max=8)
    assert hooks.override_routing(1, indices, counts) == (indices, counts)
    forced, forced_counts = hooks.override_routing(2, indices, counts)
    assert torch.equal(forced, torch.tensor([[0, 1, 2]] * 7)) and forced.dtype == indices.dtype
    assert torch.equal(forced_counts, torch.tensor([7.0, 7, 7, 0, 0, 0, 0, 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guard_flip_changes_one_bit_at_that_step_only(dtype):
    hooks = UniEPTestHooks(guard_flip_step=3, guard_flip_rank=0)
    again = torch.randn(5, 4).to(dtype)
    assert hooks.plant_guard_difference(again, 2, None) is again
    planted = hooks.plant_guard_difference(again, 3, None)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    diff = planted.view(bits) ^ again.view(bits)
    assert int((diff != 0).sum()) == 1 and int(diff.view(-1)[0]) == 1
