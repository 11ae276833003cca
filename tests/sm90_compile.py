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
    maps pointer parameters to their torch dtype, and a NamedTuple parameter
    (``kernels.scoreboard.Arena`` / ``Route``) to an instance of its type
    holding each field's type (``arena_types`` / ``route_types``): a torch
    dtype (a pointer) or a scalar type string, with ``/16`` when the value
    is 16-divisible (an element offset of the arena). Pointers, ``*stride``
    parameters and fields (int64) and ``/16`` fields are 16-divisible, other
    scalars int32; constexprs not in ``consts`` take their defaults (as the
    JIT does); ``max_registers``: Triton's ``maxnreg``. Returns the
    compiled kernel (``.asm``, ``.metadata``)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointer = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64"}

    def scalar(name, given=None):
        """(type string, 16-divisible) of a scalar parameter or field."""
        if given is not None:
            ty, _, div = given.partition("/")
            return ty, div == "16"
        return ("i64", True) if name.endswith("stride") else ("i32", False)

    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    sig, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            continue
        given = pointers.get(p.name)
        if isinstance(given, tuple):  # a NamedTuple argument: one type per field
            types = []
            for j, (field, value) in enumerate(zip(given._fields, given)):
                if isinstance(value, torch.dtype):
                    types.append(pointer[value])
                    divisible = True
                else:
                    ty, divisible = scalar(field, value)
                    types.append(ty)
                if divisible:
                    attrs[(i, j)] = [["tt.divisibility", 16]]
            sig[p.name] = type(given)(*types)
            continue
        if given is not None:
            sig[p.name] = pointer[given]
            divisible = True
        else:
            sig[p.name], divisible = scalar(p.name)
        if divisible or p.name.startswith("off_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if max_registers is not None:
        options["maxnreg"] = max_registers
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def arena_types(act):
    """``kernels.scoreboard.Arena`` field types for ``build``: the base
    addresses (int64) and the typed anchors (``act``: the activation dtype),
    the buffers' element offsets (16-divisible: every buffer starts on a
    256-byte boundary) and the capacities (int32)."""
    import torch

    from titan_uniep.kernels.scoreboard import Arena

    tensors = dict(ptrs=torch.int64, act=act, i32=torch.int32, f32=torch.float32, i64=torch.int64)
    return Arena(**{name: tensors.get(name, "i32" if name.endswith("capacity") else "i32/16")
                    for name in Arena._fields})


def route_types():
    """``kernels.scoreboard.Route`` field types for ``build``: every layout
    array int32, the strides int64 (16-divisible)."""
    import torch

    from titan_uniep.kernels.scoreboard import Route

    return Route(**{name: ("i64/16" if name.endswith("stride") else torch.int32) for name in Route._fields})


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


def releases_follow_a_barrier(ptx: str) -> bool:
    """Whether every release atomic of a PTX listing has a barrier
    (``bar.sync``) after the global stores before it: walking back from the
    atomic, a ``bar.sync`` comes before any ``st.global`` (and the listing
    has a release atomic at all)."""
    lines = [line.strip().lstrip("@%p0123456789! ") for line in ptx.split("\n")]
    atoms = [i for i, line in enumerate(lines) if re.match(r"atom\.[a-z.]*release", line)]
    for i in atoms:
        before = [line for line in reversed(lines[:i]) if line.startswith(("bar.sync", "st.global"))]
        if not before or not before[0].startswith("bar.sync"):
            return False
    return bool(atoms)


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
