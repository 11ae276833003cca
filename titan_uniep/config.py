"""The ``[uniep]`` section of a TorchTitan TOML train config.

TorchTitan merges this module's ``JobConfig`` into its own when a config sets
``[job] custom_config_module = "titan_uniep.config"`` (torchtitan/config/
manager.py). Every field is documented right under it, as in TorchTitan's
job_config.py; the same text is the CLI help (``--uniep.schedule ...``).

Checks that need only this section run in ``__post_init__``; checks that need
the parallel dimensions or the model run in the parallelize hook
(``titan_uniep.parallelize.validate``).
"""

from dataclasses import dataclass, field
from typing import Literal, get_args

ScheduleName = Literal["reference", "sequential", "fused"]
SCHEDULE_NAMES = get_args(ScheduleName)
GUARDS = ("off", "check", "strict")
TuningMode = Literal["off", "cached", "search"]
TUNING_MODES = get_args(TuningMode)
ComputeDtype = Literal["auto", "float32"]
COMPUTE_DTYPE_NAMES = get_args(ComputeDtype)


@dataclass
class UniEP:
    enable: bool = False
    """Run every MoE block's expert-parallel path (dispatch, expert FFN,
    combine and their backward) through UniEP. Needs a ``*_uniep`` model name
    (``deepseek_v3_uniep``, ``qwen3_uniep``, ``llama4_uniep``); any
    ``parallelism.expert_parallel_degree`` (at 1, each GPU runs all experts on
    its own tokens with the same kernels, no peer traffic). With
    ``enable = false`` a ``*_uniep`` model trains exactly like its base model."""

    schedule: ScheduleName = "reference"
    """How the exchange and the expert FFN run. ``"reference"``: torch
    collectives (NCCL on GPU, gloo on CPU) into UniEP's deterministic layout,
    one matmul per expert; runs anywhere and is what the kernels are tested against.
    ``"sequential"``: UniEP's Triton kernels, all communication then all
    compute. ``"fused"``: the same kernels with communication and GEMM tiles
    overlapped; bitwise equal to ``"sequential"``. Both need CUDA GPUs,
    except at ``expert_parallel_degree = 1``, where without CUDA they run in
    Triton's interpreter (correct, and slow: tests)."""

    compute_dtype: ComputeDtype = "auto"
    """The dtype of the expert GEMMs. ``"auto"``: the one TorchTitan's own
    experts use for this job, so that UniEP keeps the training's numerics:
    bf16 for its grouped-GEMM experts (every MoE flavor's default; they cast
    tokens and weights to bf16 whatever the parameters' dtype: fp32 master
    weights under AMP, bf16 under FSDP mixed precision), the tokens' dtype
    (autocast's where it is on) for its for-loop experts
    (``use_grouped_mm = False``). ``"float32"``: fp32 GEMMs (IEEE fp32 dot
    products, several times slower on GPUs). Either way the GEMMs accumulate
    in fp32, the layer's output has the tokens' dtype and every gradient its
    tensor's dtype; fp32 master weights get their gradients in fp32 from the
    kernels' weight-gradient GEMM, not rounded to bf16 (see
    ``titan_uniep.compute_dtype``)."""

    guard: Literal["off", "check", "strict"] = "off"
    """Runtime check of the bitwise contract. ``"off"``: none. ``"check"``:
    every ``guard_interval`` steps, recompute one MoE layer's output with the
    non-overlapped schedule of the same kernels and log any bitwise difference
    with layer and step; it never waits for the device (the verdict is
    copied to the host without blocking and logged at a later step's first
    forward once it has landed, or after the last step). ``"strict"``: like check, but raise on the first difference (on
    every rank, so no rank is left waiting); this costs one all-reduce and
    one host sync per checked step. Both cost one extra forward of the
    guarded layer per checked step."""

    guard_interval: int = 100
    """Steps between two guard checks (``guard`` other than ``"off"``); the
    first check runs at step 1."""

    guard_layer: int = -1
    """Which MoE layer the guard recomputes: its position among the MoE layers
    (0 = first; negative counts from the last, -1 = last)."""

    tuning: TuningMode = "off"
    """Which kernel parameters (``titan_uniep.params.LayerParams``) each MoE
    layer runs with; no tuning changes a bit. ``"off"``: the shipped defaults.
    ``"cached"``: the entry of the layer's shape in ``tuning_cache``, written
    by ``python -m titan_uniep.tools.tune``; a shape without an entry, or with only
    entries measured on another GPU, EP size or kernel version, runs the
    defaults, with one warning per shape saying why. ``"search"``: measure the
    best candidates of every MoE shape of the run at start-up (GPU only, up to
    about two minutes per shape), write them into ``tuning_cache``, then run
    them. Needs a kernel schedule (``"sequential"`` or ``"fused"``)."""

    tuning_cache: str = ""
    """The tuning cache file (JSON, see ``titan_uniep.tuning.cache``) that
    ``tuning = "cached"`` reads and ``"search"`` writes. Empty:
    ``$XDG_CACHE_HOME/titan_uniep/tuning.json`` (``~/.cache/titan_uniep/tuning.json``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.enable, bool):
            raise ValueError(f"[uniep] enable must be true or false, got {self.enable!r}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(
                f"[uniep] schedule = {self.schedule!r} is not a schedule; "
                f"use one of {', '.join(repr(s) for s in SCHEDULE_NAMES)}"
            )
        if self.compute_dtype not in COMPUTE_DTYPE_NAMES:
            raise ValueError(
                f"[uniep] compute_dtype = {self.compute_dtype!r} is not a compute dtype; "
                f"use one of {', '.join(repr(c) for c in COMPUTE_DTYPE_NAMES)}"
            )
        if self.guard not in GUARDS:
            raise ValueError(
                f"[uniep] guard = {self.guard!r} is not a guard mode; "
                f"use one of {', '.join(repr(g) for g in GUARDS)}"
            )
        if isinstance(self.guard_interval, bool) or not isinstance(self.guard_interval, int) or self.guard_interval < 1:
            raise ValueError(
                f"[uniep] guard_interval must be a positive integer (steps between checks), got {self.guard_interval!r}"
            )
        if isinstance(self.guard_layer, bool) or not isinstance(self.guard_layer, int):
            raise ValueError(f"[uniep] guard_layer must be an integer, got {self.guard_layer!r}")
        if self.tuning not in TUNING_MODES:
            raise ValueError(
                f"[uniep] tuning = {self.tuning!r} is not a tuning mode; "
                f"use one of {', '.join(repr(t) for t in TUNING_MODES)}"
            )
        if not isinstance(self.tuning_cache, str):
            raise ValueError(f"[uniep] tuning_cache must be a file path (a string), got {self.tuning_cache!r}")
        if self.tuning != "off" and self.schedule == "reference":
            raise ValueError(
                f"[uniep] tuning = {self.tuning!r} tunes UniEP's kernels, but schedule = \"reference\" runs none. "
                "Set schedule = \"fused\" (or \"sequential\"), or tuning = \"off\"."
            )


@dataclass
class JobConfig:
    """Merged into TorchTitan's JobConfig through ``[job] custom_config_module``."""

    uniep: UniEP = field(default_factory=UniEP)
