"""Compiling Triton kernels for Hopper (sm_90) on a machine without a GPU:
shared by test_kernels_compile.py and test_backward_compile.py.

Triton's wheel ships ptxas, so the whole pipeline (TTIR -> TTGIR -> PTX ->
cubin) runs here. A kernel is compilable only if TRITON_INTERPRET was unset
when it was defined, so the tests compile in a fresh subprocess
(``run_compile_script``).
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def build(fn, pointers: dict, consts: dict, *, num_warps: int, num_stages: int, max_registers: int | None = None):
    """Compile ``fn`` for sm_90 as the JIT would specialise it: ``pointers``
    maps pointer parameters to their torch dtype; pointers, ``off_*`` offsets
    and ``*stride`` parameters are 16-divisible, other scalars int32 (strides
    int64); ``max_registers``: Triton's ``maxnreg``. Returns the compiled
    kernel (``.asm``, ``.metadata``)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointer = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64"}
    sig, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            continue
        sig[p.name] = pointer[pointers[p.name]] if p.name in pointers else (
            "i64" if p.name.endswith("stride") else "i32")
        if p.name in pointers or p.name.startswith("off_") or p.name.endswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if max_registers is not None:
        options["maxnreg"] = max_registers
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def loops(ttgir: str) -> list[str]:
    """Bodies of the innermost ``scf.for`` loops of a TTGIR listing."""
    lines = ttgir.split("\n")
    bodies = []
    for i, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        for other in lines[i + 1:]:
            if other.strip().startswith("}") and len(other) - len(other.lstrip()) == indent:
                break
            body.append(other)
        text = "\n".join(body)
        if "scf.for" not in text:
            bodies.append(text)
    return bodies


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) of the kernel, from the bundled ptxas."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o", src + ".o"],
                             capture_output=True, text=True, check=True).stderr
    regs = [int(v) for v in re.findall(r"Used (\d+) registers", out)]
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", out)]
    return max(regs), max(spills or [0])


def run_compile_script(script: str) -> subprocess.CompletedProcess:
    """Run ``script`` (a test module whose ``__main__`` compiles its kernels and
    prints ``COMPILED OK``) in a fresh interpreter without TRITON_INTERPRET."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(script).resolve().parents[1]), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)


SM_SHARED_BYTES = 228 * 1024  # shared memory of an H100/H200 SM
SM_REGISTERS = 64 * 1024
SHARED_RESERVED_PER_BLOCK = 1024  # the driver's reservation per resident block


def programs_per_sm(kernel, num_warps: int) -> int:
    """How many programs of ``kernel`` an sm_90 SM holds at once (shared
    memory and registers; registers per warp are allocated in units of 256)."""
    regs, _ = ptxas_usage(kernel.asm["ptx"])
    per_warp = -(-regs * 32 // 256) * 256
    by_shared = SM_SHARED_BYTES // (kernel.metadata.shared + SHARED_RESERVED_PER_BLOCK)
    return min(by_shared, SM_REGISTERS // (per_warp * num_warps))
