"""The GPU slots of the GPU tests (``gpu_share``): never more tests at once
than slots, across processes, and every test gets one in the end."""

import multiprocessing as mp
import time

import pytest

from gpu_share import ENV_SLOTS, gpu_slot, slots


def _hold(folder, count, log, hold_s, exclusive=False):
    with gpu_slot(folder, count, poll_s=0.01, exclusive=exclusive) as index:
        log.put(("in", "all" if exclusive else index, time.monotonic()))
        time.sleep(hold_s)
        log.put(("out", "all" if exclusive else index, time.monotonic()))


@pytest.mark.timeout(60)
def test_no_more_processes_hold_slots_at_once_than_there_are_slots(tmp_path):
    """Six processes (workers) want one of two slots for 0.3 s each."""
    ctx = mp.get_context("spawn")
    log = ctx.Queue()
    workers = [ctx.Process(target=_hold, args=(tmp_path / "slots", 2, log, 0.3)) for _ in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    events = sorted((log.get(timeout=5) for _ in range(12)), key=lambda e: e[2])
    held, most, by_slot = 0, 0, {}
    for kind, index, _ in events:
        held += 1 if kind == "in" else -1
        most = max(most, held)
        if kind == "in":
            assert index not in by_slot, f"slot {index} given to two processes at once"
            by_slot[index] = True
        else:
            by_slot.pop(index)
    assert most == 2, f"{most} processes held a slot at once"


@pytest.mark.timeout(60)
def test_an_exclusive_test_holds_the_card_alone():
    """Five shared tests and two exclusive ones, three slots: while an exclusive
    test holds the card no other test does, and each gets its turn."""
    import tempfile
    from pathlib import Path

    ctx = mp.get_context("spawn")
    log = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        specs = [False, False, True, False, False, True, False]
        workers = [ctx.Process(target=_hold, args=(Path(tmp) / "slots", 3, log, 0.2, exclusive))
                   for exclusive in specs]
        for w in workers:
            w.start()
            time.sleep(0.02)
        for w in workers:
            w.join(30)
            assert w.exitcode == 0
        events = sorted((log.get(timeout=5) for _ in range(2 * len(specs))), key=lambda e: e[2])
    holders = []
    for kind, slot, _ in events:
        if kind == "in":
            assert "all" not in holders, f"{slot} got in while an exclusive test held the card"
            assert slot != "all" or not holders, f"an exclusive test got in beside {holders}"
            holders.append(slot)
        else:
            holders.remove(slot)
    assert sum(1 for kind, slot, _ in events if kind == "in" and slot == "all") == 2


def test_slot_count_follows_the_cards_memory_or_the_variable():
    gib = 1 << 30
    assert slots(79 * gib, {}) == 3  # an 80 GB H100: three GPU tests at once
    assert slots(139 * gib, {}) == 7  # an H200
    assert slots(8 * gib, {}) == 1
    assert slots(79 * gib, {ENV_SLOTS: "1"}) == 1
    with pytest.raises(ValueError, match=ENV_SLOTS):
        slots(79 * gib, {ENV_SLOTS: "0"})
