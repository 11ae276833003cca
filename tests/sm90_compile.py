"""Compiling Triton kernels for Hopper (sm_90) on a machine without a GPU,
and reading what comes out (loops of the TTGIR, ptxas' usage, the
releases, acquires and barriers of the PTX, the fences of the SASS):
shared by test_kernels_compile.py, test_backward_compile.py and
test_kernel_ptx.py.

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


BARRIER_OPS = ("bar.sync", "bar.red", "barrier.sync", "barrier.red", "barrier.cta.sync", "barrier.cta.red")


def ptx_instructions(ptx: str) -> list[tuple[str, str, str]]:
    """The instructions of a PTX listing, in order, as ``(kind, text, where)``:
    kind ``label`` (text: its name) or ``op`` (text: the instruction, with
    its predicate if any); ``where``: the source line of the last ``.loc``
    before it (``file.py:N``, the innermost of its inlining chain). Inline
    asm blocks (``{ a; b; }``) are split into their instructions;
    directives and comments are dropped."""
    out, where = [], "?"
    for raw in ptx.split("\n"):
        line, _, comment = raw.partition("//")
        line = line.strip()
        if line.startswith(".loc"):
            found = re.match(r"\s*([\w.]+:\d+)", comment)
            where = found.group(1) if found else where
            continue
        if re.fullmatch(r"[$\w]+:", line):
            out.append(("label", line[:-1], where))
            continue
        for piece in line.split(";"):
            piece = piece.strip().lstrip("{}").strip()
            if not piece or piece.startswith((".", "}")):
                continue
            out.append(("op", piece, where))
    return out


def _opcode(text: str) -> tuple[str | None, str]:
    """(predicate or None, opcode) of an instruction."""
    found = re.match(r"(@!?%\w+\s+)?(\S+)", text)
    return (found.group(1) or "").strip() or None, found.group(2)


def _is_barrier(op: str) -> bool:
    return op.startswith(BARRIER_OPS)


def _is_global_store(op: str) -> bool:
    """A store that may write global memory: ``st`` not to shared, local or
    param space (generic ``st`` included), and the bulk copies to global."""
    parts = op.split(".")
    if parts[0] == "st":
        return not any(p.startswith(("shared", "local", "param")) for p in parts[1:]) and "async" not in parts
    return bool(re.match(r"cp\.(reduce\.)?async\.bulk(\.tensor(\.\dd)?)?(\.[a-z0-9]+)*?\.global\.shared", op))


def _sync(op: str) -> tuple[bool, bool, str | None]:
    """(release, acquire, scope) of an atomic or load; scope None: none named
    (PTX's default for atom/red is .gpu)."""
    parts = op.split(".")
    if parts[0] not in ("atom", "red", "ld"):
        return False, False, None
    scope = next((p for p in parts if p in ("cta", "cluster", "gpu", "sys")), None)
    release = parts[0] in ("atom", "red") and ("release" in parts or "acq_rel" in parts)
    acquire = "acquire" in parts or (parts[0] == "atom" and "acq_rel" in parts)
    return release, acquire, scope


def ptx_sync_findings(ptx: str, scope: str | None = "sys") -> list[str]:
    """What a PTX listing gets wrong in its releases and acquires: a release
    atomic (``atom``/``red`` with ``.release`` or ``.acq_rel``) or an acquire
    (``ld.acquire``, ``atom`` with ``.acquire``/``.acq_rel``) not at
    ``scope`` (None: any scope), and a release that some path reaches from a
    global store with no barrier (``bar.sync``, ``bar.red``,
    ``barrier.sync``) between. The paths are those of the listing's control
    flow (labels, branches, loops), walked to a fixed point. Each finding
    names the source line of the instruction (``.loc``)."""
    ins = ptx_instructions(ptx)
    findings = []
    # basic blocks: split at labels and after branches / returns
    blocks, labels, current = [], {}, []
    for i, (kind, text, _) in enumerate(ins):
        if kind == "label":
            if current:
                blocks.append(current)
            current = []
            labels[text] = len(blocks)
            continue
        current.append(i)
        op = _opcode(text)[1]
        if op.startswith(("bra", "ret", "exit", "trap")):
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    successors = []
    for b, block in enumerate(blocks):
        pred, op = _opcode(ins[block[-1]][1])
        nexts = []
        if op.startswith("bra"):
            target = ins[block[-1]][1].split()[-1].rstrip(";")
            nexts.append(labels.get(target, b + 1))
            if pred is not None:
                nexts.append(b + 1)
        elif op.startswith(("ret", "exit", "trap")):
            if pred is not None:
                nexts.append(b + 1)
        else:
            nexts.append(b + 1)
        successors.append([n for n in nexts if n < len(blocks)])
    state_in = {0: frozenset()} if blocks else {}
    work = [0] if blocks else []
    reported = set()
    while work:
        b = work.pop()
        state = state_in[b]
        for i in blocks[b]:
            text, where = ins[i][1], ins[i][2]
            op = _opcode(text)[1]
            if _is_barrier(op):
                state = frozenset()
            elif _is_global_store(op):
                state = frozenset({i})
            else:
                release, acquire, named = _sync(op)
                if (release or acquire) and scope is not None and named != scope and i not in reported:
                    reported.add(i)
                    findings.append(f"{where}: `{op}` is at {named or 'default (gpu)'} scope, not {scope}")
                if release and state and ("barrier", i) not in reported:
                    reported.add(("barrier", i))
                    store = max(state)
                    findings.append(f"{where}: `{op}` follows the global store `{_opcode(ins[store][1])[1]}` "
                                    f"({ins[store][2]}) with no barrier between on some path")
        for n in successors[b]:
            merged = state_in.get(n, frozenset()) | state
            if n not in state_in or merged != state_in[n]:
                state_in[n] = merged
                work.append(n)
    return list(dict.fromkeys(findings))  # (one line per source line and message: unrolled copies repeat)


def release_sites(ptx: str) -> set[str]:
    """Source lines (``file.py:N``) of a PTX listing's release atomics."""
    return {where for kind, text, where in ptx_instructions(ptx) if kind == "op" and _sync(_opcode(text)[1])[0]}


def releases_follow_a_barrier(ptx: str) -> bool:
    """Whether every release atomic of a PTX listing has a barrier
    (``bar.sync``, ``bar.red``: ``ptx_sync_findings``) after the global
    stores before it on every path, whatever its scope (and the listing has
    a release atomic at all)."""
    return bool(release_sites(ptx)) and not ptx_sync_findings(ptx, scope=None)


def sass_fences(sass: str) -> dict[str, int]:
    """Memory barriers of a SASS listing by kind: ``MEMBAR.ALL.SYS`` (what a
    system-scope release compiles to on sm_90), ``MEMBAR.ALL.GPU``, ..."""
    kinds = re.findall(r"\bMEMBAR(?:\.[A-Z]+)+", sass)
    return {kind: kinds.count(kind) for kind in sorted(set(kinds))}


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


def run_compile_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` (a test module whose ``__main__`` compiles its kernels and
    prints ``COMPILED OK``) with ``args`` in a fresh interpreter without
    TRITON_INTERPRET."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(script).resolve().parents[1]), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=600)


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
