"""Replay known mutants of titan_uniep against the tests that must catch them.

    python3 scripts/mutate.py                          # every CPU mutant
    python3 scripts/mutate.py --only guard-layer-not-checked compare-loss-max-step-exclusive
    python3 scripts/mutate.py --device gpu             # the GPU mutants, on a GPU machine
    python3 scripts/mutate.py --list

A mutant is one exact text replacement in one file: a bug that once got
through, or one that the tests are meant to catch, with the pytest targets
that must go red. For each selected mutant the script copies the checkout's
tracked and untracked-but-not-ignored files (``git ls-files -co
--exclude-standard``: uncommitted edits count) into a temporary folder,
applies the replacement there, and runs

    python -m pytest -q -x -p no:cacheprovider TARGETS

in the copy (``python`` being the one that runs this script: the project's
venv), with ``PYTHONPATH`` at the copy, so that the copy's
``titan_uniep`` is imported and not the editable install's (checked before
each run). First, once, every selected target runs on an unmutated copy
(the baseline; ``--no-baseline`` skips it): a target that fails there would
"kill" every mutant. Verdicts, with the seconds pytest ran:

- ``killed``: the targets failed (pytest exit status 1, or 2: a collection
  error or an interrupted run), or pytest died of a signal (a CUDA error
  such as an illegal instruction ends the process in ``abort()``);
- ``survived``: they passed, so the tests let this bug through;
- ``timed out``: still running at the mutant's ``limit_s``; a kill only for
  mutants marked ``timeout_kills`` (prefer targets that fail on their own:
  pytest-timeout marks);
- ``error``: ``old`` does not occur exactly once in its file (the list went
  stale), or pytest could not run the targets (exit status 3 to 5).

``--jobs N`` judges N mutants at once, each in its own copy; ``--limit-s S``
caps every mutant's limit. Exit status 0 if every selected mutant was
killed, 1 if not, 2 if the baseline failed. The list is data
(``MUTANTS``): add a mutant with the tests that catch it (files or node
ids, no options: the baseline runs them all in one pytest); GPU mutants (``device="gpu"``, tests/gpu targets) run with
``--device gpu`` on a GPU machine.
``tests/test_mutate_script.py`` checks that every ``old`` text is still in
its file once; it never runs the mutants (minutes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    """The file to mutate, relative to the checkout."""
    old: str
    """Text that occurs exactly once in ``path``."""
    new: str
    targets: tuple[str, ...]
    """Test files or node ids, of which at least one must fail."""
    why: str
    """The bug the mutant stands for."""
    device: str = "cpu"
    """"cpu" (interpreter tests) or "gpu" (tests/gpu targets, on a GPU machine)."""
    limit_s: float = 60.0
    """Seconds the targets may run before the mutant counts as timed out."""
    timeout_kills: bool = False
    """Whether running past ``limit_s`` counts as killed (a hang the tests cannot time out themselves)."""


SCOREBOARD = "titan_uniep/kernels/scoreboard.py"
WAIT_TESTS = ("tests/test_scoreboard.py::test_a_wait_whose_counter_never_arrives_gives_up_after_its_poll_bound",
              "tests/test_scoreboard.py::test_silent_rank_stops_every_rank_with_the_root_cause")

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="wgrad-w13-block-k-called-schedule",
        path="titan_uniep/params.py",
        old='wgrad_w13_block_k: int = knob(64, "numerics",',
        new='wgrad_w13_block_k: int = knob(64, "schedule",',
        targets=("tests/test_tuning_model.py::test_every_layer_params_field_has_one_kind",
                 "tests/test_tuning_space.py"),
        why="a K step of the dW1 | dW3 GEMM (it sets the fp32 summation order) searched as a schedule field",
    ),
    Mutant(
        name="wgrad-w2-block-k-called-schedule",
        path="titan_uniep/params.py",
        old='wgrad_w2_block_k: int = knob(64, "numerics",',
        new='wgrad_w2_block_k: int = knob(64, "schedule",',
        targets=("tests/test_tuning_model.py::test_every_layer_params_field_has_one_kind",
                 "tests/test_tuning_space.py"),
        why="a K step of the dW2 GEMM searched as a schedule field",
    ),
    Mutant(
        name="guard-layer-not-checked",
        path="titan_uniep/config.py",
        old=("        if isinstance(self.guard_layer, bool) or not isinstance(self.guard_layer, int):\n"
             "            raise ValueError(f\"[uniep] guard_layer must be an integer, got {self.guard_layer!r}\")\n"),
        new="",
        targets=("tests/test_config.py::test_guard_layer_that_is_not_an_integer_is_refused_naming_the_key",
                 "tests/test_preflight.py::test_guard_layer_that_is_not_an_integer_is_refused_before_torchrun"),
        why='[uniep] guard_layer = true, "last" or 1.5 accepted by UniEP and by the launcher\'s preflight',
    ),
    Mutant(
        name="compare-loss-max-step-exclusive",
        path="titan_uniep/tools/compare_loss.py",
        old="if step <= args.max_step}",
        new="if step < args.max_step}",
        targets=("tests/test_compare_loss.py",),
        why="--max-step N drops step N: runs that differ there are called bitwise equal",
    ),
    Mutant(
        name="wait-never-times-out",
        path=SCOREBOARD,
        old="            elapsed += 1\n        waiting = (seen < expected)",
        new="            elapsed += 0\n        waiting = (seen < expected)",
        targets=WAIT_TESTS,
        why="wait_counter_at_least never reaches its interpreter poll bound: a silent rank hangs the test",
    ),
    Mutant(
        name="block-wait-never-times-out",
        path=SCOREBOARD,
        old="            elapsed += 1\n        waiting = (cta_any(missing) != 0)",
        new="            elapsed += 0\n        waiting = (cta_any(missing) != 0)",
        targets=WAIT_TESTS,
        why="wait_counters_at_least (reduce tasks' token rows) never reaches its interpreter poll bound",
    ),
    Mutant(
        name="tile-wait-one-arrival-short",
        path=SCOREBOARD,
        old="target = m1 - m0 - SLACK\n",
        new="target = m1 - m0 - SLACK - 1\n",
        targets=("tests/test_scoreboard.py::test_race_mode_finds_no_early_consumer_in_the_forward",),
        why="a GEMM tile starts one row before all of its rows have arrived (a race on a GPU)",
    ),
    Mutant(
        name="float32-compute-layer-output-zeroed",
        path="titan_uniep/torchtitan/layer.py",
        old="        return out.to(tokens_dtype)\n",
        new="        return (out - out.detach()).to(tokens_dtype)\n",
        targets=("tests/test_op.py::"
                 "test_float32_compute_of_bf16_parameters_runs_the_kernels_in_fp32_and_returns_bf16",),
        why="the UniEP layer returns zeros (its gradients stay right)",
    ),
    Mutant(
        name="op-output-zeroed",
        path="titan_uniep/op.py",
        old="        return out[0], h13\n",
        new="        return out[0].zero_(), h13\n",
        targets=("tests/test_op.py::test_master_weights_get_the_gemms_fp32_sums_as_gradients",),
        why="the op returns zeros; the 16-bit test compared its output only with another run of the op",
    ),
    Mutant(
        name="slot-order-reversed-within-expert",
        path="titan_uniep/layout.py",
        old="dest_slot = expert_base[flat_expert] + src_prefix[rank][flat_expert] + within\n",
        new="dest_slot = expert_base[flat_expert] + src_prefix[rank][flat_expert] + "
            "counts_all[rank][flat_expert] - 1 - within\n",
        targets=("tests/test_layout.py::test_receive_buffer_is_expert_major_then_source_token_k",),
        why="a source's rows of one expert land in reverse (token, k) order: still a bijection, other sums",
    ),
    Mutant(
        name="ordered-partials-summed-from-the-right",
        path="titan_uniep/kernels/ordered_sums.py",
        old=("    total = tl.load(row_ptrs, mask=mask, other=0.0)\n"
             "    for j in range(1, N):\n"
             "        total += tl.load(row_ptrs + j, mask=mask, other=0.0)\n"),
        new=("    total = tl.load(row_ptrs + N - 1, mask=mask, other=0.0)\n"
             "    for j in range(1, N):\n"
             "        total += tl.load(row_ptrs + N - 1 - j, mask=mask, other=0.0)\n"),
        targets=("tests/test_ordered_sums.py",),
        why="the router-score gradients' partials added in another order (other bits per schedule point)",
    ),
    Mutant(
        name="pairwise-sum-pairs-distant-columns",
        path="titan_uniep/kernels/ordered_sums.py",
        old="v = tl.sum(tl.reshape(v, (ROWS, v.shape[1] // 2, 2)), axis=2)",
        new="v = tl.sum(tl.reshape(v, (ROWS, 2, v.shape[1] // 2)), axis=1)",
        targets=("tests/test_ordered_sums.py",),
        why="pairwise_row_sum adds column c to c + C/2 instead of c + 1",
    ),
    # ---- GPU: the real ranks' binaries and the waits' exits (tests/gpu; a hang is a kill) ----
    Mutant(
        name="exchange-collector-reloads-its-epoch",
        path="titan_uniep/kernels/route.py",
        old=("            if not PUBLISH:  # (the epoch a PUBLISH launch stored)\n"
             "                epoch = tl.load(control + _CTL_EPOCH)\n"),
        new="            epoch = tl.load(control + _CTL_EPOCH)\n",
        targets=("tests/gpu/test_gpu_real_ranks.py::test_counts_exchange_collector_uses_the_epoch_it_published",),
        why="the collector reads back the epoch its own thread 0 stored, no barrier between: other warps take "
            "the last call's table parity",
        device="gpu", limit_s=300, timeout_kills=True,
    ),
    Mutant(
        name="wait-exit-decided-per-thread",
        path=SCOREBOARD,
        old=("        waiting = (seen < expected) & (cta_any((stop != 0) | (elapsed >= limit)) == 0)\n"
             "    stopped = cta_any(stop)\n"),
        new="        waiting = (seen < expected) & (stop == 0) & (elapsed < limit)\n    stopped = stop\n",
        targets=("tests/gpu/test_gpu_uniform_waits.py::test_a_wait_ends_for_every_thread_at_the_poll_any_thread_"
                 "gives_up",),
        why="each thread leaves wait_counter_at_least on its own timer and abort-word reads: warps meet "
            "different barriers on the failure path",
        device="gpu", limit_s=180, timeout_kills=True,
    ),
    Mutant(
        name="block-wait-exit-decided-per-thread",
        path=SCOREBOARD,
        old=("        waiting = (cta_any(missing) != 0) & (cta_any((stop != 0) | (elapsed >= limit)) == 0)\n"
             "    stopped = cta_any(stop)\n"),
        new="        waiting = (missing > 0) & (stop == 0) & (elapsed < limit)\n    stopped = stop\n",
        targets=("tests/gpu/test_gpu_uniform_waits.py::test_a_wait_ends_for_every_thread_at_the_poll_any_thread_"
                 "gives_up",),
        why="wait_counters_at_least (a reduce task's token rows) leaves its loop per thread",
        device="gpu", limit_s=180, timeout_kills=True,
    ),
    Mutant(
        name="has-failed-per-thread",
        path=SCOREBOARD,
        old="    return cta_any(tl.load(control + _CTL_ERROR, volatile=True))\n",
        new="    return (tl.load(control + _CTL_ERROR, volatile=True) != 0).to(tl.int32)\n",
        targets=("tests/gpu/test_gpu_uniform_waits.py::test_has_failed_gives_every_thread_the_same_answer",),
        why="warps disagree on whether the rank failed, around tasks that hold barriers",
        device="gpu", limit_s=180, timeout_kills=True,
    ),
    Mutant(
        name="compute-dtype-float32-ignored",
        path="titan_uniep/compute_dtype.py",
        old='    if requested == "float32":\n        return torch.float32\n',
        new='    if requested == "float32":\n        return None\n',
        targets=("tests/test_compute_dtype.py",),
        why='[uniep] compute_dtype = "float32" runs the framework\'s dtype (bf16 GEMMs) instead',
    ),
)


# A copy of the tree without its git history (as a GPU machine gets it): what is never the checkout's.
NOT_CHECKOUT = ("__pycache__", "*.egg-info", ".pytest_cache", ".git", "outputs", "out", "build", ".*")


def copy_checkout(dest: Path) -> None:
    """The checkout's tracked and untracked-not-ignored files (as they are now) into ``dest``;
    without git history, the tree but for ``NOT_CHECKOUT``."""
    listing = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                             capture_output=True)
    if listing.returncode != 0:
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(*NOT_CHECKOUT), dirs_exist_ok=True)
        return
    listed = listing.stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():  # (a tracked file deleted in the work tree is left out)
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def apply(mutant: Mutant, root: Path) -> str | None:
    """Apply ``mutant`` under ``root``; the reason it cannot be applied, or None."""
    path = root / mutant.path
    if not path.is_file():
        return f"{mutant.path} does not exist"
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        return f"its old text occurs {count} times in {mutant.path} (must be once: update the mutant)"
    path.write_text(text.replace(mutant.old, mutant.new))
    return None


def pytest_in_copy(targets: list[str], limit_s: float, device: str,
                   mutant: Mutant | None = None) -> tuple[int | None, float, list[str]]:
    """Run ``targets`` in a fresh copy of the checkout, mutated by ``mutant`` if
    given: (pytest's exit status, None if it ran past ``limit_s``; seconds;
    output lines). ValueError if the mutant does not apply."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name if mutant else 'none'}-") as tmp:
        root = Path(tmp)
        copy_checkout(root)
        reason = apply(mutant, root) if mutant else None
        if reason:
            raise ValueError(reason)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))}
        if device == "cpu":
            # Each interpreter test file sets this before it imports Triton, but a file
            # collected after one that imported Triton without it would skip itself.
            env["TRITON_INTERPRET"] = "1"
        origin = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                                 "print(u.find_spec('titan_uniep').origin)"], cwd=root, env=env, check=True,
                                capture_output=True, text=True).stdout.strip()
        if not Path(origin).resolve().is_relative_to(root.resolve()):
            sys.exit(f"the copy imports titan_uniep from {origin}, not from the copy: no mutant would be tested")
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *targets]
        start = time.monotonic()
        # A session of its own, so that a timeout ends pytest and every process it started.
        proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=limit_s)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            status = None
        return status, time.monotonic() - start, output.strip().splitlines()


def judge(mutant: Mutant) -> tuple[str, float, str]:
    """(verdict, seconds, detail) of one mutant (``mutant.limit_s``: its time limit)."""
    try:
        status, seconds, lines = pytest_in_copy(list(mutant.targets), mutant.limit_s, mutant.device, mutant)
    except ValueError as err:
        return "error", 0.0, str(err)
    if status is None:
        return "killed" if mutant.timeout_kills else "timed out", seconds, f"still running after {mutant.limit_s:.0f} s"
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    if status in (1, 2):
        return "killed", seconds, (failed or lines[-1:] or [""])[0]
    if status < 0:  # the test process crashed (a CUDA error ends in abort())
        died = f"pytest died of {signal.Signals(-status).name}"
        return "killed", seconds, died + (f" after {failed[0]}" if failed else "")
    if status == 0:
        return "survived", seconds, lines[-1] if lines else ""
    return "error", seconds, f"pytest exit status {status}: " + " | ".join(lines[-5:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="which mutants to run (default cpu)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the first run of every selected target on the unmutated copy")
    parser.add_argument("--limit-s", type=float, default=None,
                        help="at most this many seconds per mutant (below its own limit; a mutant that hangs "
                             "is killed at its limit)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants judged at once, each in its own copy")
    args = parser.parse_args(argv)
    names = [m.name for m in MUTANTS]
    if len(set(names)) != len(names):
        parser.error("two mutants share a name")
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            parser.error(f"unknown mutant(s) {unknown}; the mutants: {', '.join(names)}")
        selected = [m for m in MUTANTS if m.name in args.only]
    else:
        selected = [m for m in MUTANTS if m.device == args.device]
    if args.limit_s is not None:
        selected = [dataclasses.replace(m, limit_s=min(m.limit_s, args.limit_s)) for m in selected]
    if args.list:
        for m in selected if args.only else MUTANTS:
            print(f"{m.name} [{m.device}, {m.limit_s:.0f} s] {m.path}: {m.why}\n    {' '.join(m.targets)}")
        return 0
    if not selected:
        print(f"no {args.device} mutants in the list")
        return 0
    for device in ([] if args.no_baseline else sorted({m.device for m in selected})):
        # Every target must pass unmutated, else a failure under a mutant proves nothing.
        targets = list(dict.fromkeys(t for m in selected if m.device == device for t in m.targets))
        status, seconds, lines = pytest_in_copy(targets, sum(m.limit_s for m in selected), device)
        if status != 0:
            print(f"baseline ({device}): the unmutated targets do not pass ({seconds:.1f} s); no mutant was run",
                  *lines[-15:], sep="\n")
            return 2
        print(f"baseline ({device}): {lines[-1] if lines else ''} ({seconds:.1f} s)", flush=True)
    width = max(len(m.name) for m in selected)
    results = []
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for mutant, (verdict, seconds, detail) in zip(selected, pool.map(judge, selected)):
            results.append(verdict)
            print(f"{mutant.name:<{width}}  {verdict:<9}  {seconds:6.1f} s  {detail}", flush=True)
    killed = results.count("killed")
    print(f"{killed} of {len(results)} mutants killed")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
