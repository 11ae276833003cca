"""Every exit of the scoreboard's waits, and every ``has_failed`` branch, is
decided from a value all threads of the program share.

A scalar load and the timer are read by every thread, and warps can see
different values (another program sets the abort word or the error record
mid-poll, a bound runs out between two warps' reads). The waits' loop bodies
hold barriers (the acquire's broadcast, ``tl.sum``): warps leaving at
different polls would meet different barriers. These kernels give each warp
its own view on purpose (warp 0 one abort word, bound or error record, the
other warps another) and record what every thread decided, one word per
thread: every thread must decide alike, and at the first poll that any
thread's view ends the wait.
"""

import time

import pytest
import torch
import triton
import triton.language as tl

from titan_uniep.kernels.scoreboard import (CONTROL_WORDS, CTL_ERROR, has_failed, wait_counter_at_least,
                                            wait_counters_at_least)

pytestmark = [pytest.mark.gpu]

NUM_WARPS = 4
THREADS = 32 * NUM_WARPS
LONG_US = 200_000  # a bound no wait of these kernels may reach
_CONTROL_WORDS = tl.constexpr(CONTROL_WORDS)


@triton.jit
def _warp_view(dummy):
    """0 in the program's first warp, 1 in the others (each thread its own)."""
    tid = tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [dummy], dtype=tl.int32, is_pure=False, pack=1)
    return tl.minimum(tid // 32, 1)


@triton.jit
def _record(out_address, value):
    """Store ``value`` (int64) of every thread at ``out[tid]`` (a scalar store
    would be thread 0's alone)."""
    tid = tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [value.to(tl.int32)], dtype=tl.int32,
                                    is_pure=False, pack=1)
    tl.inline_asm_elementwise("st.global.b64 [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,l",
                              [out_address + tid.to(tl.int64) * 8, value.to(tl.int64)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def scalar_wait_kernel(counter, aborts, bounds, expected, out_address):
    view = _warp_view(expected)
    seen, stopped = wait_counter_at_least(counter, expected, aborts + view, tl.load(bounds + view), True, "gpu")
    _record(out_address, stopped * 1_000_000 + seen)


@triton.jit
def block_wait_kernel(counters, aborts, bounds, expected, out_address, N: tl.constexpr):
    view = _warp_view(expected)
    offs = tl.arange(0, N)
    seen, stopped = wait_counters_at_least(counters + offs, offs < N, expected, aborts + view,
                                           tl.load(bounds + view), True, "gpu")
    _record(out_address, stopped * 1_000_000 + tl.min(seen))


@triton.jit
def has_failed_kernel(controls, out_address):
    view = _warp_view(out_address.to(tl.int32))
    _record(out_address, has_failed(controls + view * _CONTROL_WORDS))


def launch(kernel, *args, **meta):
    """One program of ``NUM_WARPS`` warps; returns every thread's recorded word and the seconds it ran."""
    out = torch.full((THREADS,), -1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    kernel[(1,)](*args, out.data_ptr(), num_warps=NUM_WARPS, **meta)
    torch.cuda.synchronize()
    return out.cpu(), time.perf_counter() - start


def words(*values):
    return torch.tensor(values, dtype=torch.int64, device="cuda")


@pytest.mark.parametrize("kernel", ["scalar", "block"])
@pytest.mark.parametrize("view", ["abort word", "bound"])
def test_a_wait_ends_for_every_thread_at_the_poll_any_thread_gives_up(kernel, view):
    """Nothing arrives. ``abort word``: only warps 1-3 see it set; ``bound``:
    warp 0's bound is zero, the others' long. Every thread leaves at once and
    returns the same (stopped, seen)."""
    aborts = words(0, 5) if view == "abort word" else words(0, 0)
    bounds = torch.tensor([LONG_US, LONG_US] if view == "abort word" else [0, LONG_US], dtype=torch.int32,
                          device="cuda")
    if kernel == "scalar":
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        args = (counter, aborts, bounds, 3)
        launch(scalar_wait_kernel, *args)  # compile
        out, seconds = launch(scalar_wait_kernel, *args)
    else:
        counters = torch.tensor([3] * 8 + [1] * 8, dtype=torch.int32, device="cuda")  # half of them short
        args = (counters, aborts, bounds, 3)
        launch(block_wait_kernel, *args, N=16)
        out, seconds = launch(block_wait_kernel, *args, N=16)
    assert (out == out[0]).all(), f"threads decided differently: {sorted(set(out.tolist()))}"
    stopped, seen = divmod(int(out[0]), 1_000_000)
    assert stopped == (view == "abort word") and seen < 3, (stopped, seen)
    assert seconds < 0.05, f"the wait ran {seconds:.3f} s: some warp polled on after another gave up"


def test_a_wait_that_is_met_returns_the_same_in_every_thread():
    counter = torch.full((1,), 3, dtype=torch.int32, device="cuda")
    args = (counter, words(0, 5), torch.tensor([LONG_US, LONG_US], dtype=torch.int32, device="cuda"), 3)
    launch(scalar_wait_kernel, *args)
    out, _ = launch(scalar_wait_kernel, *args)
    assert (out == 3).all(), sorted(set(out.tolist()))  # met at the first poll: the abort word is not read


def test_has_failed_gives_every_thread_the_same_answer():
    """Warp 0 reads an error record that is clear, warps 1-3 one that is set
    (another program set it between their reads): all say failed."""
    controls = torch.zeros(2, CONTROL_WORDS, dtype=torch.int64, device="cuda")
    controls[1, CTL_ERROR] = 1
    launch(has_failed_kernel, controls)
    out, _ = launch(has_failed_kernel, controls)
    assert (out == 1).all(), f"threads decided differently: {out.tolist()}"
