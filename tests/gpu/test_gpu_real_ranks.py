"""Real-rank mode on one GPU (``titan_uniep.tools.real_ranks``): the binaries
a rank of a real EP group launches (one rank per launch, system scope, the
counts exchange in one launch, waits that spin on another rank's launch),
W ranks in one process on streams of their own.

- Consecutive fused calls with random per-rank delays, the ranks drifting
  apart: every call's output and gradients bitwise equal to the simulated
  world's sequential schedule (and its fused schedule to that).
- The counts exchange's collector reads back no word it stored: its first
  warp, which issues the scalar epoch store, held back on purpose
  (``LayerParams.debug_epoch_store_delay_us``) while the other warps go on,
  consecutive calls with other counts still route right (W = 1, the EP = 1
  training path, and W = 2).
- Failures: a silent rank, a bad slot, an abort landing in the counts
  exchange, a rank that sends no row: every rank stops within twice the
  bound, every error names the first failing rank, phase and counter, and
  the next call fails before it launches.

The stress command runs the same at scale: ``python -m
titan_uniep.tools.real_ranks --world 2 --world 4 --world 8 --calls 1000``.
"""

import pytest
import torch

from titan_uniep.tools.real_ranks import RealRankWorld

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_exclusive]


@pytest.mark.parametrize("case, world", [("after", 2), ("before", 4), ("empty_rank", 2), ("after", 8)])
def test_real_ranks_give_the_sequential_schedules_bits_call_after_call(case, world):
    rr = RealRankWorld(case, world, sets=3, seed=world)
    rr.compile()
    report = rr.run(24, max_delay_us=300, seed=world)
    assert report.simulated_fused_equals_sequential, "the simulated world's fused schedule differs from sequential"
    assert not report.errors, report.errors
    assert report.mismatched_calls == 0, report.first_mismatch


@pytest.mark.parametrize("world", [1, 2])
def test_counts_exchange_collector_uses_the_epoch_it_published(world):
    """A collector that read the epoch back from memory would, with its storing
    warp late, take the last call's table parity in its other warps: the
    counts of the last call (input sets alternate) or of none."""
    rr = RealRankWorld("after", world, sets=2, seed=11, hooks=dict(debug_epoch_store_delay_us=100))
    rr.compile()
    report = rr.run(6, max_delay_us=0, seed=1)
    assert not report.errors, report.errors
    assert report.mismatched_calls == 0, report.first_mismatch


@pytest.mark.parametrize("failure, world", [("silent", 2), ("bad_slot", 2), ("mid_tile", 2), ("exchange_abort", 4),
                                            ("mid_tile", 4)])
def test_a_failure_stops_every_rank_within_twice_the_bound_naming_the_first(failure, world):
    rr = RealRankWorld("after", world, sets=1, seed=21)
    report = rr.inject(failure, bound_s=0.5)
    assert not report.problems(), (report.problems(), report.messages, report.records)
    if failure == "bad_slot":
        assert report.root == world - 1
    if failure == "exchange_abort":  # rank 0's bound runs out first; the others' is eight times longer
        assert report.root == 0


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
