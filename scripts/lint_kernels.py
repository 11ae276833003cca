"""Lint of the kernels' memory-ordering rules, read from their source (AST only).

    python3 scripts/lint_kernels.py            # titan_uniep/kernels/*.py
    python3 scripts/lint_kernels.py FILE ...   # other files, analysed together

Prints one line per finding, ``path:line: rule: message``, and exits 1 if
there is any. Needs nothing but Python (no triton, no torch).

Rules, over every ``@triton.jit`` function of the files:

``atomic-sem-scope``
    every ``tl.atomic_*`` call names both ``sem=`` and ``scope=`` (a string,
    or a constexpr name such as ``SCOPE``). Triton's defaults are
    ``acq_rel`` at GPU scope: a flag a peer on another GPU reads needs
    ``scope="sys"``, and a counter that orders nothing should say
    ``relaxed``.

``store-reload``
    no reload of a word after a store to it without a barrier between: a
    ``tl.store(P, ...)`` followed in program order by a ``tl.load(P, ...)``
    (the same pointer expression, ``ast.unparse`` equal, none of its names
    assigned in between) with no barrier on some path between them. A scalar
    ``tl.store`` is issued by one thread and a scalar ``tl.load`` by every
    thread, so the other warps may read the old value (DESIGN.md,
    "Pitfalls").

``release-before-barrier``
    a flag release comes after a barrier that follows the last data store:
    on no path may a ``tl.store`` reach a release atomic (``sem="release"``
    or ``"acq_rel"``, Triton's default) without a barrier between, since a
    release orders only its own thread's stores and the other threads'
    stores reach it only through the barrier.

Barriers: ``tl.debug_barrier()``; a helper whose inline asm holds
``bar.sync`` / ``bar.red`` / ``barrier.sync`` (``cta_barrier``, ``cta_any``:
a call is a barrier, also inside an expression such as
``mask_m = mask_m & cta_barrier(m0)``); and a helper every path of which
passes a barrier (``has_failed``, the wait functions ending in
``tl.debug_barrier()``).

The rules are interprocedural over the files' ``@triton.jit`` helpers: each
call of a helper applies its summary, computed for the constexpr values the
call passes (literals, or the caller's known ones): whether some path
through it passes no barrier (then the caller's pending stores stay
pending), the stores pending when it returns (they dirty the caller), and
whether it issues a release before any barrier and any store of its own
(then the call is a release event: the caller's pending stores are a
finding at the call). A release preceded by the helper's own stores is a
finding inside the helper, not at its callers.

Approximations (so read a finding, and a clean run, with these in mind):

- Control flow is the statements' structure: an ``if`` joins its two
  branches (a store pending on either is pending after it), a loop is
  walked until its state repeats (the back edge included). A branch whose
  test is a constexpr expression that evaluates (a literal or a known
  constexpr) takes only its side; an unknown constexpr test marks each side
  (``if PUBLISH:`` / ``if not PUBLISH:``), and a store from one side is not
  carried into the other side of a later test of the same expression.
  The two sides of one runtime ``if`` are one path each: a branch on a
  value the threads disagree on is another bug (``cta_any``).
- Calls inside one expression are taken in evaluation order, all of them
  (a barrier in one arm of a conditional expression counts).
- What Triton adds by itself (the barrier around a reduction, a scalar
  atomic's broadcast through shared memory) is not counted: the source must
  say it. The PTX check (``tests/test_kernel_ptx.py``) reads the binaries.
- Kernels are analysed with their constexprs unknown: every combination
  the branches allow, some of which no launch uses.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "titan_uniep" / "kernels"

SEMANTICS = ("relaxed", "acquire", "release", "acq_rel")
SCOPES = ("cta", "gpu", "sys")
RELEASES = ("release", "acq_rel")
BARRIER_ASM = re.compile(r"\b(bar|barrier)(\.cta)?\.(sync|red)\b")
UNKNOWN = object()


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.message}"


@dataclass(frozen=True)
class Pending:
    """A store not yet followed by a barrier (``entry``: the caller's
    pending stores, inside a helper's summary)."""

    line: int  # the store's line, or the line of the call whose helper stored
    origin: str  # path:line of the tl.store
    via: tuple = ()  # the helpers it was made through, outermost first
    pointer: str | None = None  # the stored pointer's text (None: a helper's store, never matched by a load)
    names: frozenset = frozenset()  # the names that pointer is built from
    sides: frozenset = frozenset()  # (constexpr test, side) of the branches it was stored under
    entry: bool = False

    def __str__(self) -> str:
        return self.origin + (f" (through {' -> '.join(self.via)})" if self.via else "")


ENTRY = Pending(0, "the caller", entry=True)


@dataclass
class Summary:
    passes: bool = False  # some path from entry to return passes no barrier
    exit_stores: frozenset = frozenset()  # its own stores pending at a return
    releases_on_entry: str | None = None  # path:line of a release reached before any barrier and any own store


@dataclass
class Function:
    module: str
    path: str
    node: ast.FunctionDef
    constexprs: set = field(default_factory=set)
    params: list = field(default_factory=list)  # (name, is constexpr, default node)


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) in ("triton.jit", "jit")


def _is_constexpr_annotation(node: ast.expr | None) -> bool:
    return node is not None and ast.unparse(node).split(".")[-1] == "constexpr"


def _tl_call(call: ast.Call) -> str | None:
    """``store`` for ``tl.store(...)``, etc."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "tl":
        return func.attr
    return None


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _names(node: ast.AST) -> frozenset:
    return frozenset(n.id for n in ast.walk(node) if isinstance(n, ast.Name))


def _calls_in_order(node: ast.AST):
    """The calls of an expression in evaluation order (arguments before the call)."""
    if isinstance(node, ast.Call):
        yield from _calls_in_order(node.func)
        for arg in node.args:
            yield from _calls_in_order(arg)
        for keyword in node.keywords:
            yield from _calls_in_order(keyword.value)
        yield node
        return
    for child in ast.iter_child_nodes(node):
        yield from _calls_in_order(child)


def _assigned(target: ast.AST) -> set:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _side(test: ast.expr) -> tuple[str, bool]:
    """``(expression, True)`` for ``if E:``, ``(E, False)`` for ``if not E:``."""
    polarity = True
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, polarity = test.operand, not polarity
    return ast.unparse(test), polarity


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b, ast.BitAnd: lambda a, b: a & b,
           ast.BitOr: lambda a, b: a | b}
_COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
            ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b}


def _evaluate(node: ast.expr, values: dict, truths: dict):
    """The value of a constexpr expression from the known constexprs, or UNKNOWN.
    ``truths``: names only known true or false (a branch taken on them)."""
    try:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return values.get(node.id, UNKNOWN)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            if isinstance(node.operand, ast.Name) and node.operand.id in truths:
                return not truths[node.operand.id]
            value = _evaluate(node.operand, values, truths)
            return UNKNOWN if value is UNKNOWN else not value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = _evaluate(node.operand, values, truths)
            return UNKNOWN if value is UNKNOWN else -value
        if isinstance(node, ast.BoolOp):
            parts = [truths[v.id] if isinstance(v, ast.Name) and v.id in truths else _evaluate(v, values, truths)
                     for v in node.values]
            decisive = isinstance(node.op, ast.Or)  # the value that decides an or (True) / an and (False)
            if any(p is not UNKNOWN and bool(p) == decisive for p in parts):
                return decisive
            return UNKNOWN if any(p is UNKNOWN for p in parts) else not decisive
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = _evaluate(node.left, values, truths), _evaluate(node.right, values, truths)
            return UNKNOWN if UNKNOWN in (a, b) else _BINARY[type(node.op)](a, b)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
            a, b = _evaluate(node.left, values, truths), _evaluate(node.comparators[0], values, truths)
            return UNKNOWN if UNKNOWN in (a, b) else _COMPARE[type(node.ops[0])](a, b)
    except (ArithmeticError, TypeError, ValueError):  # an expression the lint cannot fold
        return UNKNOWN
    return UNKNOWN


class Linter:
    """Parses the sources, then analyses every root ``@triton.jit`` function
    (one no other calls) and, through the calls, the helpers."""

    def __init__(self, sources: dict[str, str]):
        self.findings: set[Finding] = set()
        self.functions: dict[tuple[str, str], Function] = {}
        self.imports: dict[str, dict[str, tuple[str, str]]] = {}
        self.module_constexprs: dict[str, set] = {}
        self.barrier_helpers: set[tuple[str, str]] = set()
        self.summaries: dict = {}
        self.in_progress: set = set()
        self.trees = {}
        for path, text in sources.items():
            module = Path(path).stem
            tree = ast.parse(text, filename=path)
            self.trees[path] = (module, tree)
            self.imports[module] = {}
            self.module_constexprs[module] = set()
            for node in tree.body:
                if isinstance(node, ast.ImportFrom) and node.module:
                    for alias in node.names:
                        self.imports[module][alias.asname or alias.name] = (node.module.split(".")[-1], alias.name)
                elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                        and ast.unparse(node.value.func).split(".")[-1] == "constexpr":
                    self.module_constexprs[module] |= {n for t in node.targets for n in _assigned(t)}
                elif isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                    self.functions[(module, node.name)] = self._function(module, path, node)

    def _function(self, module: str, path: str, node: ast.FunctionDef) -> Function:
        fn = Function(module, path, node)
        args = node.args.posonlyargs + node.args.args
        defaults = [None] * (len(args) - len(node.args.defaults)) + list(node.args.defaults)
        for arg, default in zip(args, defaults):
            constexpr = _is_constexpr_annotation(arg.annotation)
            fn.params.append((arg.arg, constexpr, default))
            if constexpr:
                fn.constexprs.add(arg.arg)
        for sub in ast.walk(node):
            if isinstance(sub, ast.AnnAssign) and _is_constexpr_annotation(sub.annotation):
                fn.constexprs |= _assigned(sub.target)
            if isinstance(sub, ast.Call) and _tl_call(sub) == "inline_asm_elementwise":
                asm = sub.args[0] if sub.args else _keyword(sub, "asm")
                if isinstance(asm, ast.Constant) and isinstance(asm.value, str) and BARRIER_ASM.search(asm.value):
                    self.barrier_helpers.add((module, node.name))
        return fn

    def resolve(self, module: str, call: ast.Call) -> tuple[str, str] | None:
        """The package's jit function a call names, if any."""
        if not isinstance(call.func, ast.Name):
            return None
        name = call.func.id
        if (module, name) in self.functions:
            return (module, name)
        imported = self.imports.get(module, {}).get(name)
        if imported in self.functions:
            return imported
        same = [key for key in self.functions if key[1] == name]
        return same[0] if len(same) == 1 and imported is None else None

    def report(self, fn: Function, line: int, rule: str, message: str) -> None:
        self.findings.add(Finding(fn.path, line, rule, message))

    def run(self) -> list[Finding]:
        for path, (module, tree) in self.trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and (_tl_call(node) or "").startswith("atomic_"):
                    self._check_atomic(path, node)
        called = set()
        for key, fn in self.functions.items():
            for node in ast.walk(fn.node):
                if isinstance(node, ast.Call):
                    target = self.resolve(fn.module, node)
                    if target is not None and target != key:
                        called.add(target)
        for key in self.functions:
            if key not in called and key not in self.barrier_helpers:
                self.summary(key, {}, {})
        return sorted(self.findings, key=lambda f: (f.path, f.line, f.rule, f.message))

    def _check_atomic(self, path: str, call: ast.Call) -> None:
        what = f"tl.{_tl_call(call)}"
        for name, allowed in (("sem", SEMANTICS), ("scope", SCOPES)):
            value = _keyword(call, name)
            if value is None:
                self.findings.add(Finding(path, call.lineno, "atomic-sem-scope",
                                          f"{what} names no {name}= (Triton's default: "
                                          f"{'acq_rel' if name == 'sem' else 'gpu'})"))
            elif isinstance(value, ast.Constant) and value.value not in allowed:
                self.findings.add(Finding(path, call.lineno, "atomic-sem-scope",
                                          f"{what}: {name}={value.value!r} is none of {allowed}"))
            elif not isinstance(value, (ast.Constant, ast.Name)):
                self.findings.add(Finding(path, call.lineno, "atomic-sem-scope",
                                          f"{what}: {name}= is neither a string nor a constexpr name"))

    # ---- the analysis of one function, for some constexpr values ----

    def summary(self, key: tuple[str, str], values: dict, truths: dict) -> Summary:
        fn = self.functions[key]
        memo = (key, tuple(sorted(values.items(), key=repr)), tuple(sorted(truths.items())))
        if memo in self.summaries:
            return self.summaries[memo]
        if memo in self.in_progress:  # (recursion: jit functions do not recurse; be safe)
            return Summary(passes=True)
        self.in_progress.add(memo)
        walk = _Walk(self, fn, values, truths)
        end = walk.block(fn.node.body, frozenset({ENTRY}))
        exits = walk.exits + ([end] if end is not None else [])
        result = Summary(
            passes=any(ENTRY in state for state in exits),
            exit_stores=frozenset(p for state in exits for p in state if not p.entry),
            releases_on_entry=walk.release_on_entry,
        )
        self.in_progress.discard(memo)
        self.summaries[memo] = result
        return result


class _Walk:
    """The walk of one function body: the state is the set of pending stores."""

    def __init__(self, linter: Linter, fn: Function, values: dict, truths: dict):
        self.linter = linter
        self.fn = fn
        self.values = dict(values)
        self.truths = dict(truths)
        self.sides: tuple = ()  # (test, side) of the unknown constexpr branches around the statement
        self.exits: list = []
        self.release_on_entry: str | None = None
        self.constexprs = fn.constexprs | linter.module_constexprs.get(fn.module, set())

    # statements

    def block(self, body, state):
        for stmt in body:
            if state is None:
                return None
            state = self.statement(stmt, state)
        return state

    def statement(self, stmt, state):
        if isinstance(stmt, ast.If):
            return self.branch(stmt, state)
        if isinstance(stmt, (ast.For, ast.While)):
            return self.loop(stmt, state)
        if isinstance(stmt, ast.Return):
            if stmt.value is not None:
                state = self.expression(stmt.value, state)
            self.exits.append(state)
            return None
        if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            if stmt.value is not None:
                state = self.expression(stmt.value, state)
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names = set().union(*(_assigned(t) for t in targets))
            if isinstance(stmt, ast.AnnAssign) and _is_constexpr_annotation(stmt.annotation) and stmt.value:
                value = _evaluate(stmt.value, self.values, self.truths)
                for name in names:
                    if value is UNKNOWN:
                        self.values.pop(name, None)
                    else:
                        self.values[name] = value
            return self.forget(state, names)
        if isinstance(stmt, ast.Expr):
            return self.expression(stmt.value, state)
        for child in ast.iter_child_nodes(stmt):  # assert, pass, ...: their calls, if any
            if isinstance(child, ast.expr):
                state = self.expression(child, state)
        return state

    def branch(self, stmt: ast.If, state):
        state = self.expression(stmt.test, state)
        value = _evaluate(stmt.test, self.values, self.truths)
        if value is not UNKNOWN:
            return self.block(stmt.body if value else stmt.orelse, state)
        constexpr = not any(isinstance(n, ast.Call) for n in ast.walk(stmt.test)) and \
            _names(stmt.test) <= self.constexprs
        if not constexpr:
            return self.join(self.block(stmt.body, state), self.block(stmt.orelse, state))
        test, polarity = _side(stmt.test)
        name = test if re.fullmatch(r"\w+", test) else None
        ends = []
        for side, body in ((polarity, stmt.body), (not polarity, stmt.orelse)):
            # a store made under the other side of this test is not on this path
            kept = frozenset(p for p in state if (test, not side) not in p.sides)
            saved_sides, saved_truths = self.sides, dict(self.truths)
            self.sides = self.sides + ((test, side),)
            if name is not None:
                self.truths[name] = side
            ends.append(self.block(body, kept))
            self.sides, self.truths = saved_sides, saved_truths
        return self.join(*ends)

    def loop(self, stmt, state):
        if isinstance(stmt, ast.For):
            state = self.forget(self.expression(stmt.iter, state), _assigned(stmt.target))
        head = state
        while True:
            entered = self.expression(stmt.test, head) if isinstance(stmt, ast.While) else head
            after = self.block(stmt.body, entered)
            if isinstance(stmt, ast.For) and after is not None:
                after = self.forget(after, _assigned(stmt.target))
            new_head = self.join(head, after)
            if new_head == head:
                break
            head = new_head
        return self.expression(stmt.test, head) if isinstance(stmt, ast.While) else head

    @staticmethod
    def join(*states):
        live = [s for s in states if s is not None]
        return frozenset().union(*live) if live else None

    @staticmethod
    def forget(state, names):
        """A store whose pointer is built from a reassigned name stored another
        word than a load of that text reads now (still pending for a release)."""
        if state is None or not names:
            return state
        return frozenset(replace(p, pointer=None, names=frozenset()) if p.names & names else p for p in state)

    # expressions

    def expression(self, node, state):
        for call in _calls_in_order(node):
            if state is None:
                return None
            state = self.call(call, state)
        return state

    def call(self, call: ast.Call, state):
        kind = _tl_call(call)
        if kind == "debug_barrier":
            return frozenset()
        if kind == "store" and call.args:
            pointer = call.args[0]
            return state | {Pending(call.lineno, f"{self.fn.path}:{call.lineno}", (), ast.unparse(pointer),
                                    _names(pointer), frozenset(self.sides))}
        if kind == "load" and call.args:
            text = ast.unparse(call.args[0])
            for p in sorted(state, key=lambda p: p.line):
                if p.pointer == text:
                    self.linter.report(self.fn, call.lineno, "store-reload",
                                       f"tl.load({text}) reloads the word stored at line {p.line} with no barrier "
                                       "between (a scalar store is one thread's: the other warps may read the "
                                       "old value)")
                    break
            return state
        if kind is not None and kind.startswith("atomic_"):
            sem = _keyword(call, "sem")
            release = sem is None or not isinstance(sem, ast.Constant) or sem.value in RELEASES
            if release:
                self.release(call.lineno, f"tl.{kind}(sem={ast.unparse(sem) if sem is not None else 'default'})",
                             f"{self.fn.path}:{call.lineno}", state)
            return state
        target = self.linter.resolve(self.fn.module, call)
        if target is None:
            return state
        if target in self.linter.barrier_helpers:
            return frozenset()
        values, truths = self.bindings(self.linter.functions[target], call)
        summary = self.linter.summary(target, values, truths)
        if summary.releases_on_entry is not None:
            self.release(call.lineno, f"{target[1]} (its release at {summary.releases_on_entry})",
                         summary.releases_on_entry, state)
        kept = state if summary.passes else frozenset()
        stores = {Pending(call.lineno, p.origin, (target[1],) + p.via, sides=frozenset(self.sides))
                  for p in summary.exit_stores}
        return kept | stores

    def release(self, line: int, what: str, origin: str, state) -> None:
        """A release at ``line`` (``origin``: the atomic's path:line)."""
        own = sorted((p for p in state if not p.entry), key=lambda p: (p.line, p.origin))
        if own:
            self.linter.report(self.fn, line, "release-before-barrier",
                               f"release {what} follows the store at {own[-1]} with no barrier between")
        elif ENTRY in state and self.release_on_entry is None:
            self.release_on_entry = origin

    def bindings(self, callee: Function, call: ast.Call) -> tuple[dict, dict]:
        """The constexpr values a call passes: literals, the caller's known
        constexprs, else the callee's defaults where the call passes nothing."""
        given = dict(zip([p[0] for p in callee.params], call.args))
        given.update({k.arg: k.value for k in call.keywords if k.arg})
        values, truths = {}, {}
        for name, constexpr, default in callee.params:
            if not constexpr:
                continue
            if name in given:
                node = given[name]
                value = _evaluate(node, self.values, self.truths)
                if value is UNKNOWN and isinstance(node, ast.Name) and node.id in self.truths:
                    truths[name] = self.truths[node.id]
            else:
                value = UNKNOWN if default is None else _evaluate(default, {}, {})
            if value is not UNKNOWN:
                values[name] = value
        return values, truths


def lint_sources(sources: dict[str, str]) -> list[Finding]:
    """Findings of the rules over ``{path: source}``, analysed together."""
    return Linter(sources).run()


def lint_paths(paths) -> list[Finding]:
    sources = {}
    for path in paths:
        path = Path(path).resolve()
        try:
            shown = str(path.relative_to(REPO))
        except ValueError:
            shown = str(path)
        sources[shown] = path.read_text()
    return lint_sources(sources)


def main(argv: list[str]) -> int:
    paths = argv or sorted(KERNELS.glob("*.py"))
    findings = lint_paths(paths)
    for finding in findings:
        print(finding)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
