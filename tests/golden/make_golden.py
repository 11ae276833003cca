"""Golden digests: the exact output bits of UniEP's simulated-world forward and
backward, frozen so that a restructure can prove it changed no bit.

    python tests/golden/make_golden.py --device cpu  --out tests/golden/interpreter.json
    python tests/golden/make_golden.py --device cuda --out tests/golden/h200_bf16.json   # one H200
    python tests/golden/make_golden.py --check tests/golden/interpreter.json              # exit 1 on a mismatch

``--device cpu`` runs the "cpu" cases under the Triton interpreter
(TRITON_INTERPRET=1, fp32 plus one fp16 case: the interpreter's bf16 tl.dot is
wrong); ``--device cuda`` runs the "gpu" cases (bf16, one GPU, simulated
worlds). ``--check FILE`` recomputes the cases named in FILE (their kind gives
the device unless ``--device`` is given) and compares every digest.
``--only REGEX`` restricts to matching case names (both modes).

Per case and per schedule ("sequential", "fused"): the forward (with a
saved_h13 buffer) gives every rank's output and the h1 | h3 rows of the slots
the call uses (rank r's first ``used[r]`` slots: the copies routed to its
experts; the buffer starts as NaN and the script checks that exactly those
rows were written); then the backward with those saved h1 | h3 gives dx,
dscores, dw1, dw2, dw3 of every rank (``bwd_saved.*``).
Digest = sha256 over (str(dtype), tuple(shape), the raw bytes). JSON:
``{case_name: {schedule: {tensor_name: hexdigest}}}``. The script also checks
that both schedules give the same digests and that every tensor is finite.

The digests in ``interpreter.json`` were frozen from the code before the
``LayerParams`` / ``runtime`` restructure (commit a5d4819) and must stay
equal: only ``make_params``, ``run_forward`` and ``run_backward`` (the
ADAPTER section below) touch titan_uniep's API; cases, inputs, digests, JSON
and CLI must stay as they are, or the digests stop being comparable. (The
recomputing backward's ``bwd_recompute.*`` digests were deleted from both
JSON files with that path; every other digest is the frozen one.)
"""

from __future__ import annotations

import os
import platform
import sys


def _argv_value(flag: str) -> str | None:
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _early_device() -> str:
    """The device, decided before torch / triton are imported (triton reads
    TRITON_INTERPRET when a kernel is defined)."""
    device = _argv_value("--device")
    if device is None and _argv_value("--check") is not None:
        import json

        try:
            with open(_argv_value("--check")) as f:
                names = list(json.load(f))
        except (OSError, ValueError):
            names = []
        device = "cuda" if names and all(n.startswith("gpu_") for n in names) else "cpu"
    return device or "cpu"


if _early_device() == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    # The interpreter's tl.dot is numpy's matmul, and numpy's OpenBLAS picks its fp32
    # kernel, so its summation order, by the CPU it runs on: the frozen digests were taken
    # with its AVX2 (Haswell) kernels, and an AVX-512 CPU picks others (SkylakeX: other
    # bits in 4 of the 5 CI cases). OpenBLAS reads this once, when numpy loads it.
    if platform.machine().lower() in ("x86_64", "amd64"):
        os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")
elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("make_golden.py: --device cuda with TRITON_INTERPRET set; unset it (GPU goldens are compiled kernels)")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ("sequential", "fused")
GRAD_NAMES = ("dx", "dscores", "dw1", "dw2", "dw3")

# ---- cases ------------------------------------------------------------------
# kind "cpu": interpreter (interpreter_config tiles: 16 wide), small shapes:
# H = 24 (masked column blocks of fc1 / dH, a masked K step in fc2 / dA) and
# H = 48, D = 32 and one D = 24 (masked K in fc1); few tokens per rank (the
# interpreter is slow). kind "gpu": bf16 on one H200, one
# case per shape class of the expert hidden dim (H <= 1024, 1024 < H <= 2048,
# H > 2048). Every base case runs with scores after and before the experts.

_CPU_BASE = [
    dict(name="cpu_w1_e4_k2_random", W=1, E=4, K=2, T=[11], H=24, routing="random", seed=101),
    dict(name="cpu_w2_e4_k3_random", W=2, E=4, K=3, T=[0, 9], H=48, routing="random", seed=102),
    dict(name="cpu_w4_e8_k2_skewed", W=4, E=8, K=2, T=[3, 0, 5, 2], H=24, routing="skewed", seed=103),
    dict(name="cpu_w4_e4_k1_skewed", W=4, E=4, K=1, T=[5, 3, 0, 7], H=48, D=24, routing="skewed",
         seed=104),  # El = 1
    dict(name="cpu_w2_e6_k2_localfirst", W=2, E=6, K=2, T=[7, 9], H=24, routing="skewed", seed=106,
         params=dict(local_first=True)),
    dict(name="cpu_w2_e4_k2_fp16", W=2, E=4, K=2, T=[9, 7], H=24, routing="random", seed=107, dtype="float16"),
]
for _c in _CPU_BASE:
    _c.update(kind="cpu", D=_c.get("D", 32), dtype=_c.get("dtype", "float32"))

_GPU_BASE = [
    # H <= 1024 (default_config: every program dispatches first, short fc2 / dA tiles)
    dict(name="gpu_w2_e16_k4_h768", W=2, E=16, K=4, T=[601, 0], D=2048, H=768, routing="random", seed=201),
    # 1024 < H <= 2048 (EP-size default forward, short dA backward tiles)
    dict(name="gpu_w1_e8_k2_h1536", W=1, E=8, K=2, T=[513], D=1536, H=1536, routing="skewed", seed=202),
    # H > 2048 (defaults everywhere); D not a power of two
    dict(name="gpu_w4_e8_k2_h2560", W=4, E=8, K=2, T=[301, 0, 257, 299], D=1000, H=2560, routing="random",
         seed=203),
]
for _c in _GPU_BASE:
    _c.update(kind="gpu", dtype="bfloat16")


def _expand(base: list[dict]) -> list[dict]:
    cases = []
    for c in base:
        for score_before in (False, True):
            case = dict(c, params=dict(c.get("params", {})), score_before=score_before)
            case["name"] = f"{c['name']}_{'before' if score_before else 'after'}"
            cases.append(case)
    return cases


CASES = _expand(_CPU_BASE) + _expand(_GPU_BASE)
CASE_BY_NAME = {c["name"]: c for c in CASES}
assert len(CASE_BY_NAME) == len(CASES)


# ---- inputs -------------------------------------------------------------------


def make_inputs(case: dict, device: str) -> dict:
    """Fresh random data of a simulated world, from a CPU generator seeded per
    case, then moved to ``device``. Per rank r: x, grad_out ``(T_r, D)``,
    scores ``(T_r, K)`` fp32 in (0, 1), indices ``(T_r, K)`` int64 (distinct
    experts per token; "skewed": expert 0 plus random others), and rank r's
    local experts' w1, w3 ``(El, H, D)``, w2 ``(El, D, H)``."""
    gen = torch.Generator().manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    world, E, K, D, H = case["W"], case["E"], case["K"], case["D"], case["H"]
    assert E % world == 0 and K <= E
    el = E // world

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    w1 = randn(E, H, D, scale=D**-0.5)
    w3 = randn(E, H, D, scale=D**-0.5)
    w2 = randn(E, D, H, scale=H**-0.5)
    xs, grads, scores, indices = [], [], [], []
    for t in case["T"]:
        xs.append(randn(t, D))
        grads.append(randn(t, D))
        scores.append(0.02 + 0.96 * torch.rand(t, K, generator=gen))
        if case["routing"] == "random":
            picked = torch.rand(t, E, generator=gen).argsort(1)[:, :K]
        elif case["routing"] == "skewed":  # every token picks expert 0, plus K - 1 random others
            others = 1 + torch.rand(t, E - 1, generator=gen).argsort(1)[:, : K - 1]
            picked = torch.cat([torch.zeros(t, 1, dtype=torch.int64), others], 1)
        else:
            raise ValueError(f"unknown routing {case['routing']!r}")
        indices.append(picked.to(torch.int64).contiguous())
    local = lambda w: [w[r * el:(r + 1) * el].contiguous().to(device) for r in range(world)]  # noqa: E731
    dev = lambda ts: [t.contiguous().to(device) for t in ts]  # noqa: E731
    # Slots rank r's forward fills: one per (token, k) copy routed to its experts, from every source.
    used = [int(sum(int((idx // el == r).sum()) for idx in indices)) for r in range(world)]
    return dict(xs=dev(xs), grads=dev(grads), scores=dev(scores), indices=dev(indices), w1s=local(w1),
                w2s=local(w2), w3s=local(w3), used_slots=used)


# ---- ADAPTER: the only code that depends on titan_uniep's API ------------------


def _import_titan_uniep():
    if str(REPO_ROOT) not in sys.path[:1]:
        sys.path.insert(0, str(REPO_ROOT))  # this checkout's package, not an installed one
    import titan_uniep

    where = Path(titan_uniep.__file__).resolve()
    if REPO_ROOT not in where.parents:
        raise RuntimeError(f"imported titan_uniep from {where}, not from this checkout ({REPO_ROOT})")
    return titan_uniep


def make_params(case: dict):
    """The LayerParams of a case: interpreter tiles on CPU; on the GPU exactly
    ``default_params(W, hidden=H)``; ``params`` applied on top
    (the cases name the fields by their names when the digests were frozen:
    ``local_first`` kept its name)."""
    _import_titan_uniep()
    from titan_uniep.params import default_params, interpreter_params

    changes = dict(case["params"])
    if case["kind"] == "cpu":
        return interpreter_params(**changes)
    params = default_params(case["W"], hidden=case["H"])
    return params.replace(**changes) if changes else params


def run_forward(params, inputs: dict, *, schedule: str, score_before: bool):
    """Returns (outs, h13): the W outputs ``(T_r, D)`` and the saved h1 | h3
    buffer ``(W, S, 2H)`` (rank r's used slots are rows ``[0, used[r])`` in
    slot order; it starts as NaN, unused rows stay so)."""
    _import_titan_uniep()
    from titan_uniep.runtime import simulated_moe_forward
    from titan_uniep.layout import slot_capacity

    i = inputs
    world, (el, hidden, _) = len(i["xs"]), i["w1s"][0].shape
    tokens = max(max(x.shape[0] for x in i["xs"]), 1)
    slots = slot_capacity(world, tokens, i["indices"][0].shape[1], el)
    h13 = torch.full((world, slots, 2 * hidden), float("nan"), dtype=i["xs"][0].dtype, device=i["xs"][0].device)
    outs = simulated_moe_forward(i["xs"], i["scores"], i["indices"], i["w1s"], i["w2s"], i["w3s"],
                                 schedule=schedule, score_before_experts=score_before, params=params,
                                 saved_h13=h13)
    return outs, h13


def run_backward(params, inputs: dict, *, schedule: str, score_before: bool, saved_h13):
    """Returns one (dx, dscores, dw1, dw2, dw3) per rank; ``saved_h13``: the
    forward's buffer."""
    _import_titan_uniep()
    from titan_uniep.runtime import simulated_moe_backward

    i = inputs
    return simulated_moe_backward(i["grads"], i["xs"], i["scores"], i["indices"], i["w1s"], i["w2s"], i["w3s"],
                                  schedule=schedule, score_before_experts=score_before, params=params,
                                  saved_h13=saved_h13)


# ---- digests --------------------------------------------------------------------


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    flat = t.reshape(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    h = hashlib.sha256()
    h.update(str(t.dtype).encode())
    h.update(b"|")
    h.update(str(tuple(t.shape)).encode())
    h.update(b"|")
    h.update(flat.numpy().tobytes())
    return h.hexdigest()


def run_case(case: dict, device: str, problems: list[str]) -> dict:
    """{schedule: {tensor_name: hexdigest}} of one case; sanity failures go to ``problems``."""
    inputs = make_inputs(case, device)
    params = make_params(case)
    name, world, score_before = case["name"], case["W"], case["score_before"]
    result = {}
    for schedule in SCHEDULES:
        tensors = {}
        outs, h13 = run_forward(params, inputs, schedule=schedule, score_before=score_before)
        for r in range(world):
            tensors[f"fwd.out.r{r}"] = outs[r]
            used = inputs["used_slots"][r]
            rows = h13[r, :used]
            tensors[f"fwd.h13.r{r}"] = rows
            if not torch.isnan(h13[r, used:]).all():
                problems.append(f"{name} {schedule}: rank {r} h13 rows past the {used} used slots were written")
        grads = run_backward(params, inputs, schedule=schedule, score_before=score_before, saved_h13=h13)
        for r in range(world):
            for gname, g in zip(GRAD_NAMES, grads[r]):
                tensors[f"bwd_saved.{gname}.r{r}"] = g
        for tname, t in tensors.items():
            if t.is_floating_point() and not torch.isfinite(t).all():
                problems.append(f"{name} {schedule}: {tname} has NaN / inf")
        result[schedule] = {tname: digest(t) for tname, t in sorted(tensors.items())}
    seq, fus = result["sequential"], result["fused"]
    differ = sorted(k for k in set(seq) | set(fus) if seq.get(k) != fus.get(k))
    if differ:
        problems.append(f"SEQUENTIAL != FUSED in {name}: {', '.join(differ)}")
    return result


def _worker(name: str, device: str) -> tuple:
    """One case (in a worker process with ``--jobs``): (name, result, problems, timing, titan_uniep dir)."""
    package = str(Path(_import_titan_uniep().__file__).parent)  # the import is not part of the case's time
    problems: list[str] = []
    t0, c0 = time.perf_counter(), time.process_time()
    result = run_case(CASE_BY_NAME[name], device, problems)
    timing = f"{time.perf_counter() - t0:.1f} s, cpu {time.process_time() - c0:.1f} s"
    return name, result, problems, timing, package


def _run_cases(names: list[str], device: str, jobs: int):
    """Yields (name, result, problems, timing, titan_uniep dir) per case, in completion order."""
    if jobs <= 1:
        for name in names:
            yield _worker(name, device)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        # Larger worlds first (they take longest), for a balanced finish.
        order = sorted(names, key=lambda n: (-CASE_BY_NAME[n]["W"], -CASE_BY_NAME[n]["E"]))
        futures = [pool.submit(_worker, name, device) for name in order]
        for future in as_completed(futures):
            yield future.result()


def _select(kind: str | None, only: str | None, names=None) -> list[dict]:
    cases = CASES if names is None else [CASE_BY_NAME[n] for n in names if n in CASE_BY_NAME]
    if kind is not None:
        cases = [c for c in cases if c["kind"] == kind]
    if only:
        cases = [c for c in cases if re.search(only, c["name"])]
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), help="cpu: the 'cpu' cases (interpreter); cuda: the 'gpu' ones")
    ap.add_argument("--out", help="write the digests here (JSON)")
    ap.add_argument("--check", metavar="FILE", help="recompute the cases in FILE and compare")
    ap.add_argument("--only", metavar="REGEX", help="only cases whose name matches")
    ap.add_argument("--jobs", type=int, help="worker processes (cpu: default min(2, cores); cuda: always 1)")
    args = ap.parse_args()
    if bool(args.out) == bool(args.check):
        ap.error("give exactly one of --out and --check")
    device = args.device or _early_device()
    kind = "cpu" if device == "cpu" else "gpu"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device")
    if device == "cpu" and torch.cuda.is_available():
        print("note: a CUDA device is present, the cpu cases still run on CPU under the interpreter")
    jobs = 1 if device == "cuda" else (args.jobs or min(2, os.cpu_count() or 1))
    print(f"torch {torch.__version__}; device {device}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}; "
          f"{jobs} job(s)" + (f"; {torch.cuda.get_device_name()}" if device == "cuda" else ""))

    golden = None
    if args.check:
        golden = json.loads(Path(args.check).read_text())
        missing = [n for n in golden if n not in CASE_BY_NAME]
        cases = _select(kind, args.only, [n for n in golden if n in CASE_BY_NAME])
        extra = [c["name"] for c in _select(kind, args.only) if c["name"] not in golden]
        if extra:
            print(f"note: {len(extra)} {kind} cases not in {args.check} (not checked): {', '.join(extra)}")
    else:
        missing = []
        cases = _select(kind, args.only)
    if not cases:
        print("no cases selected")
        return 1

    problems: list[str] = []
    results, mismatched, where = {}, [], set()
    start = time.perf_counter()
    for name, res, case_problems, took, package in _run_cases([c["name"] for c in cases], device, jobs):
        if package not in where:
            print(f"titan_uniep from {package}")
            where.add(package)
        results[name] = res
        problems += case_problems
        if golden is None:
            print(f"{name}: {sum(len(v) for v in res.values())} digests ({took})")
            continue
        want = golden[name]
        bad = []
        for schedule in sorted(set(want) | set(res)):
            w, g = want.get(schedule, {}), res.get(schedule, {})
            bad += [f"{schedule}/{t}" for t in sorted(set(w) | set(g)) if w.get(t) != g.get(t)]
        if bad:
            mismatched.append(name)
            print(f"MISMATCH {name} ({took}): {', '.join(bad)}")
        else:
            print(f"OK {name} ({took})")
    total = time.perf_counter() - start
    results = {c["name"]: results[c["name"]] for c in cases}  # case order, whatever finished first
    for name in missing:
        mismatched.append(name)
        print(f"MISMATCH {name}: not a case of this script")
    digests = sum(len(v) for res in results.values() for v in res.values())
    print(f"{len(results)} cases, {digests} digests, {total:.1f} s")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"wrote {out}")
    for p in problems:
        print(f"PROBLEM: {p}")
    if not problems:
        print("sequential == fused everywhere; every tensor finite; h13 writes only the used slots")
    if args.check:
        print(f"check: {len(mismatched)} mismatched of {len(results) + len(missing)}"
              + ("" if mismatched else " -- all OK"))
    return 1 if (mismatched or problems) else 0


if __name__ == "__main__":
    sys.exit(main())
