"""``scripts/lint_kernels.py``: the kernels' source keeps its memory-ordering
rules (every atomic names its semantics and scope; no reload of a stored
word without a barrier; no release before a barrier that follows the data
stores), and each rule flags the defect it is for, planted in small sources."""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "lint_kernels.py"

_spec = importlib.util.spec_from_file_location("lint_kernels", SCRIPT)
lint_kernels = importlib.util.module_from_spec(_spec)
sys.modules["lint_kernels"] = lint_kernels  # (dataclasses look their module up)
_spec.loader.exec_module(lint_kernels)

HEADER = """
import triton
import triton.language as tl
"""


def planted(text: str) -> str:
    return HEADER + textwrap.dedent(text)


def lint(**modules: str) -> list[str]:
    """Findings (``module.py:line: rule: message``) of planted sources, one per module name."""
    sources = {f"{name}.py": planted(text) for name, text in modules.items()}
    return [str(f) for f in lint_kernels.lint_sources(sources)]


def line(text: str, snippet: str, nth: int = 0) -> int:
    """The line of a planted source holding ``snippet`` (its ``nth``)."""
    return [i for i, row in enumerate(planted(text).splitlines(), 1) if snippet in row][nth]


def rules(findings: list[str]) -> list[str]:
    return [f.split(": ")[1] for f in findings]


def test_the_kernels_pass_the_lint_from_a_clean_clone():
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


def test_the_script_prints_each_finding_and_exits_1(tmp_path):
    path = (tmp_path / "planted.py").resolve()
    path.write_text(planted("""
        @triton.jit
        def publish(data, flag, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(data + offs, offs)
            tl.atomic_add(flag, 1)
            return tl.load(data + offs)
    """))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        f"{path}:9: atomic-sem-scope: tl.atomic_add names no scope= (Triton's default: gpu)",
        f"{path}:9: atomic-sem-scope: tl.atomic_add names no sem= (Triton's default: acq_rel)",
        f"{path}:9: release-before-barrier: release tl.atomic_add(sem=default) follows the store at "
        f"{path}:8 with no barrier between",
        f"{path}:10: store-reload: tl.load(data + offs) reloads the word stored at line 8 with no barrier "
        "between (a scalar store is one thread's: the other warps may read the old value)",
    ], proc.stdout


# ---- atomic-sem-scope ----

ATOMICS = """
@triton.jit
def claim(counter, flag, SCOPE: tl.constexpr):
    tl.atomic_add(counter, 1, sem="relaxed")
    tl.atomic_xchg(flag, 1, sem="release", scope=SCOPE)
    tl.atomic_cas(flag, 0, 1, sem="relaxed", scope="device")
"""


def test_an_atomic_without_scope_or_with_an_unknown_one_is_flagged():
    assert lint(k=ATOMICS) == [
        f"k.py:{line(ATOMICS, 'atomic_add')}: atomic-sem-scope: tl.atomic_add names no scope= (Triton's default: gpu)",
        f"k.py:{line(ATOMICS, 'atomic_cas')}: atomic-sem-scope: tl.atomic_cas: scope='device' is none of "
        "('cta', 'gpu', 'sys')",
    ]


# ---- store-reload ----

# route.exchange_counts_kernel before the fix: the collector stored the epoch in its
# PUBLISH block and every thread reloaded it in its COLLECT block, no barrier between.
EXCHANGE_BEFORE = """
@triton.jit
def exchange(control, flags, PUBLISH: tl.constexpr, COLLECT: tl.constexpr):
    collector = True
    if PUBLISH:
        epoch = tl.load(control + _CTL_EPOCH) + 1
        ticket = tl.atomic_add(control + 7, 1, sem="acq_rel", scope="sys")
        collector = ticket == 3
        if collector:
            tl.atomic_xchg(flags, epoch, sem="release", scope="sys")
            tl.store(control + _CTL_EPOCH, epoch)
    if COLLECT:
        if collector:
            epoch = tl.load(control + _CTL_EPOCH)
            seen = tl.atomic_add(flags, 0, sem="acquire", scope="sys")
"""

# ... and after: the reload only where PUBLISH did not run in the same launch.
EXCHANGE_AFTER = EXCHANGE_BEFORE.replace(
    "            epoch = tl.load(control + _CTL_EPOCH)\n",
    "            if not PUBLISH:\n                epoch = tl.load(control + _CTL_EPOCH)\n")


def test_the_counts_exchange_reloading_its_stored_epoch_is_flagged():
    reload, store = line(EXCHANGE_BEFORE, "tl.load(control + _CTL_EPOCH)", 1), line(EXCHANGE_BEFORE, "tl.store(")
    assert lint(route=EXCHANGE_BEFORE) == [
        f"route.py:{reload}: store-reload: tl.load(control + _CTL_EPOCH) reloads the word stored at line {store} "
        "with no barrier between (a scalar store is one thread's: the other warps may read the old value)"]


def test_a_reload_under_the_other_side_of_the_constexpr_test_is_not_flagged():
    assert lint(route=EXCHANGE_AFTER) == []


def test_a_barrier_or_a_new_pointer_between_store_and_reload_clears_it():
    findings = lint(k="""
        @triton.jit
        def cta_any(flag):
            return tl.inline_asm_elementwise("{ bar.red.or.pred %p, 0, %q; }", "=r,r", [flag], dtype=tl.int32,
                                             is_pure=False, pack=1)

        @triton.jit
        def stored_then_read(word, other):
            tl.store(word + 1, 5)
            tl.debug_barrier()
            a = tl.load(word + 1)
            tl.store(word + 2, a)
            b = cta_any(a)  # bar.red: a barrier
            c = tl.load(word + 2)
            tl.store(word + 3, c)
            word = other  # another word now
            return tl.load(word + 3) + b
    """)
    assert findings == [], findings


SPIN = """
@triton.jit
def spin(word, n):
    i = 0
    while i < n:
        seen = tl.load(word)
        tl.store(word, seen + 1)
        i += 1
"""


def test_a_reload_through_a_loops_back_edge_is_flagged():
    findings = lint(k=SPIN)
    assert rules(findings) == ["store-reload"], findings
    assert findings[0].startswith(f"k.py:{line(SPIN, 'tl.load')}:"), findings
    assert lint(k=SPIN.replace("        i += 1", "        i += 1\n        tl.debug_barrier()")) == []


# ---- release-before-barrier ----

PUBLISH = """
@triton.jit
def publish(data, flag, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(data + offs, offs)
    tl.atomic_add(flag, 1, sem="release", scope="sys")
    tl.debug_barrier()
    tl.atomic_add(flag, 1, sem="release", scope="sys")
    tl.atomic_add(flag, 1, sem="relaxed", scope="gpu")
"""


def test_a_release_right_after_a_store_is_flagged():
    assert lint(k=PUBLISH) == [
        f"k.py:{line(PUBLISH, 'atomic_add')}: release-before-barrier: release tl.atomic_add(sem='release') follows "
        f"the store at k.py:{line(PUBLISH, 'tl.store')} with no barrier between"]


RELEASE_AT_THE_TOP = """
@triton.jit
def kernel(out, flags, n, BM: tl.constexpr):
    rows = tl.arange(0, BM)
    task = 0
    while task < n:
        tl.atomic_add(flags + rows, 1, sem="release", scope="sys")  # the previous task's rows
        tl.store(out + task * BM + rows, rows)
        task += 1
"""


def test_a_release_after_the_previous_iterations_stores_is_flagged():
    findings = lint(k=RELEASE_AT_THE_TOP)
    assert rules(findings) == ["release-before-barrier"], findings
    assert findings[0].startswith(f"k.py:{line(RELEASE_AT_THE_TOP, 'atomic_add')}:"), findings
    assert lint(k=RELEASE_AT_THE_TOP.replace("        task += 1", "        task += 1\n        tl.debug_barrier()")) \
        == []


# fc2_combine's shape: a helper stores the rows, a barrier (inline asm ANDed into the
# mask, or tl.debug_barrier), a helper releases them (now, or deferred past the next
# tile's K-loop); a wait helper ends in a barrier.
FC2_SHAPE = """
@triton.jit
def cta_barrier(x):
    zero = tl.inline_asm_elementwise("bar.sync 0;\\n\\tmov.u32 $0, 0;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)
    return zero == 0

@triton.jit
def store_rows(out, rows, mask):
    tl.store(out + rows, rows, mask=mask)
    return rows

@triton.jit
def release_rows(flags, rows, mask, SCOPE: tl.constexpr):
    tl.atomic_add(flags + rows, 1, mask=mask, sem="release", scope=SCOPE)

@triton.jit
def release_or_defer(flags, rows, mask, DEFER: tl.constexpr, SCOPE: tl.constexpr):
    if not DEFER:
        release_rows(flags, rows, mask, SCOPE)
    return mask

@triton.jit
def wait_for(counter, SCOPE: tl.constexpr):
    seen = tl.atomic_add(counter, 0, sem="acquire", scope=SCOPE)
    tl.debug_barrier()
    return seen

@triton.jit
def tile(out, flags, m0, BM: tl.constexpr, FLAT: tl.constexpr, DEFER: tl.constexpr, SCOPE: tl.constexpr):
    rows = m0 + tl.arange(0, BM)
    mask = rows < 100
    if DEFER:
        release_rows(flags, rows - BM, mask, SCOPE)  # the previous tile's
    store_rows(out, rows, mask)
    if FLAT:
        mask = mask & cta_barrier(m0)
    else:
        tl.debug_barrier()
    return release_or_defer(flags, rows, mask, DEFER, SCOPE)

@triton.jit
def kernel(out, flags, counter, n, BM: tl.constexpr, FLAT: tl.constexpr, DEFER: tl.constexpr,
           SCOPE: tl.constexpr):
    task = tl.program_id(0)
    while task < n:
        mask = tile(out, flags, task * BM, BM, FLAT, DEFER, SCOPE)
        task += tl.num_programs(0)
    tl.store(out, 1)
    wait_for(counter, SCOPE)
    if DEFER:
        release_rows(flags, tl.arange(0, BM), mask, SCOPE)
"""


def test_the_fc2_shape_with_its_barriers_is_clean():
    assert lint(fc2=FC2_SHAPE) == []


def test_a_missing_barrier_before_a_helpers_release_is_flagged_at_the_call():
    source = FC2_SHAPE.replace("        tl.debug_barrier()\n    return release_or_defer",
                               "        pass\n    return release_or_defer")
    store = line(source, "tl.store(out + rows")
    assert lint(fc2=source) == [
        # not deferred: the release right after the rows
        f"fc2.py:{line(source, 'return release_or_defer')}: release-before-barrier: release release_or_defer "
        f"(its release at fc2.py:{line(source, 'tl.atomic_add(flags')}) follows the store at fc2.py:{store} "
        "(through store_rows) with no barrier between",
        # deferred: the next tile's first release (the loop's back edge)
        f"fc2.py:{line(source, 'mask = tile(')}: release-before-barrier: release tile (its release at "
        f"fc2.py:{line(source, 'tl.atomic_add(flags')}) follows the store at fc2.py:{store} "
        "(through tile -> store_rows) with no barrier between",
    ]


def test_a_barrier_on_one_branch_only_leaves_the_other_path_flagged():
    source = FC2_SHAPE.replace("mask = mask & cta_barrier(m0)", "mask = mask")
    findings = lint(fc2=source)
    assert [f.split(": ")[0] for f in findings] == [f"fc2.py:{line(source, 'return release_or_defer')}",
                                                   f"fc2.py:{line(source, 'mask = tile(')}"], findings


def test_a_helpers_stores_under_a_constexpr_its_callers_pass_false_are_not_pending():
    source = """
        @triton.jit
        def record(control, WAIT: tl.constexpr):
            if WAIT:
                tl.store(control + 1, 1)

        @triton.jit
        def task(control, flag, WAIT: tl.constexpr):
            record(control, WAIT)
            tl.atomic_add(flag, 1, sem="release", scope="sys")

        @triton.jit
        def kernel(control, flag):
            task(control, flag, False)
    """
    assert lint(k=source) == []
    source = source.replace("task(control, flag, False)", "task(control, flag, True)")
    assert lint(k=source) == [
        f"k.py:{line(source, 'atomic_add')}: release-before-barrier: release tl.atomic_add(sem='release') follows "
        f"the store at k.py:{line(source, 'tl.store')} (through record) with no barrier between"]
