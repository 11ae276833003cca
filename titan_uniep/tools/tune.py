"""Measured search of UniEP's kernel parameters per MoE layer shape; writes the tuning cache.

    python3 -m titan_uniep.tools.tune --shape qwen3_1gpu --shape 8192,2880,1440,64,4      # one GPU: EP 1
    python3 -m titan_uniep.tools.tune --config train_configs/qwen3_30b_a3b_4l_uniep.toml  # its shapes, NGPU = 1
    torchrun --nproc_per_node 2 -m titan_uniep.tools.tune --config train_configs/qwen3_30b_a3b_4l_uniep.toml

The command line of ``titan_uniep.tuning.search``, whose docstring has the
steps. For each layer shape (``--shape``: a ``titan_uniep.shapes`` name or
``T,D,H,E,K`` with ``T`` tokens per rank; ``--config``: every MoE shape the
train config builds, at its tokens per rank ``local_batch_size * seq_len /
context_parallel_degree``), on the EP group of the launch (plain python is
EP 1), per direction: the analytic model (``--constants``) ranks the grid;
its ``--top`` points, the default and (unless ``--no-neighbours``) the
one-stage neighbours of its best are measured on the real path in
``--rounds`` rounds of alternating order, median of ``--reps`` calls; the
fastest is measured again against the default (``--confirm-rounds``
rounds) and picked if it beats it by ``--min-gain`` and gives its bits.
The tuned layer is compared bit for bit with the default once more, then
merged into the cache file (``--cache``, by rank 0, after each shape). A
schedule point whose bits differ is a broken contract: reported, exit 1.

The backward is timed with its weight gradients in the dtype the training
writes them in (``--weight-grad-dtype``; with ``--config``, fp32 where
TorchTitan applies no FSDP, as at NGPU = 1: fp32 master weights).
``--numerics`` lets the candidates change summation-order fields too: they
are measured and reported, but a point that changes bits is never cached.
A progress bar per shape counts the measurements. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from titan_uniep.shapes import add_shape_argument
from titan_uniep.tuning.cache import default_cache_path, dtype_name, save
from titan_uniep.tuning.search import MoELayer, SearchOptions, SearchResult, search_layer

__all__ = ["build_parser", "config_layers", "main", "requested_layers"]

PROG = "python3 -m titan_uniep.tools.tune"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- shapes of a train config -----------------------------------------------------------


def config_layers(path: str, world: int = 1) -> tuple[list[MoELayer], int]:
    """Every distinct MoE layer shape of the train config at ``path``, at its
    tokens per rank, the dtype its kernels compute in
    (``compute_dtype.job_compute_dtype``) and the dtype its weight gradients
    are written in when it trains on ``world`` GPUs
    (``compute_dtype.job_weight_grad_dtype``: fp32 where TorchTitan applies no
    FSDP and the kernels compute in 16 bits), and its EP degree. Builds the
    model on the meta device (no memory), as the trainer does."""
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.moe.moe import MoE
    from torchtitan.protocols.train_spec import get_train_spec

    from titan_uniep.compute_dtype import job_compute_dtype, job_weight_grad_dtype
    from titan_uniep.torchtitan import edge_module

    if edge_module() != "titan_uniep.torchtitan.v0_2":
        raise ValueError(f"--config {path}: reading the MoE shapes of a TOML train config needs TorchTitan 0.2.2; "
                         "on another TorchTitan pass the layer shapes with --shape")
    importlib.import_module(edge_module())  # registers the *_uniep train specs and flavors

    job = ConfigManager().parse_args(["--job.config_file", path])
    spec = get_train_spec(job.model.name)
    args = copy.deepcopy(spec.model_args[job.model.flavor])
    args.update_from_config(job)
    with torch.device("meta"):
        model = spec.model_cls(args)
    tokens = job.training.local_batch_size * job.training.seq_len // max(1, job.parallelism.context_parallel_degree)
    par = job.parallelism
    try:
        fsdp = ParallelDims(dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
                            cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                            pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree,
                            etp=par.expert_tensor_parallel_degree, world_size=world).fsdp_enabled
    except (AssertionError, ValueError) as err:
        raise ValueError(f"--config {path}: its parallelism does not fit {world} GPU(s) ({err})") from None
    shapes = {}
    for fqn, moe in ((fqn, m) for fqn, m in model.named_modules() if isinstance(m, MoE)):
        num_experts, hidden, dim = moe.experts.w1.shape
        dtype = job_compute_dtype(job.uniep.compute_dtype, framework_casts_to_bf16=moe.experts.use_grouped_mm,
                                  activation_dtype=job.training.mixed_precision_param)
        layer = MoELayer(f"{job.model.flavor}:{fqn}", tokens, dim, hidden, num_experts, moe.router.top_k,
                         moe.score_before_experts, dtype,
                         job_weight_grad_dtype(dtype, fsdp=fsdp,
                                               mixed_precision_param=job.training.mixed_precision_param))
        shapes.setdefault(dataclasses.replace(layer, name=""), layer)
    if not shapes:
        raise ValueError(f"--config {path}: model {job.model.name!r} flavor {job.model.flavor!r} has no MoE layers")
    return list(shapes.values()), job.parallelism.expert_parallel_degree


# ---- command line ---------------------------------------------------------------------


def init_group() -> tuple[dist.ProcessGroup, torch.device]:
    """The EP group of this launch: torchrun's world, or a one-rank group for plain python."""
    if "RANK" not in os.environ:
        with socket.socket() as s:  # a free port for the one-rank store
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    return dist.group.WORLD, dev


def print_result(res: SearchResult) -> None:
    grad_dtype = res.layer.weight_grad_dtype
    grads = f", weight gradients in {dtype_name(grad_dtype)}" if grad_dtype not in (None, res.layer.dtype) else ""
    print(f"== {res.layer.name}: T={res.layer.tokens} D={res.layer.dim} H={res.layer.hidden} "
          f"E={res.layer.num_experts} K={res.layer.top_k} {dtype_name(res.layer.dtype)}{grads}", flush=True)
    for direction, rows in res.table.items():
        print(f"| {direction} point | measured ms | model ms | |\n|---|---|---|---|")
        for row in sorted(rows, key=lambda r: float("inf") if r["measured_ms"] is None else r["measured_ms"]):
            ms = "failed" if row["measured_ms"] is None else f"{row['measured_ms']:.3f}"
            print(f"| {row['point']} | {ms} | {row['predicted_ms']:.3f} | {'picked' if row['picked'] else ''} |")
    for line in res.problems:
        print(f"note: {line}")
    for line in res.violations:
        print(f"BITWISE CONTRACT BROKEN: {line}")
    if res.entry is not None:
        print(f"entry: forward {res.entry.forward or 'default'}, backward {res.entry.backward or 'default'}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_argument(parser)
    parser.add_argument("--config", default=None, help="tune every MoE shape of this train config (TOML)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default=None, help="with --shape (default bf16)")
    parser.add_argument("--score-before", action="store_true", help="with --shape: scores multiply the inputs")
    parser.add_argument("--weight-grad-dtype", choices=("auto", "data", "float32"), default="auto",
                        help="the weight gradients' dtype the backward is timed in: the data's, or float32 (fp32 "
                             "master weights: TorchTitan without FSDP, e.g. NGPU=1); auto: with --config the "
                             "config's at this launch's GPU count, with --shape the data's")
    parser.add_argument("--top", type=int, default=SearchOptions.top, help="model candidates per direction")
    parser.add_argument("--numerics", action="store_true",
                        help="also try fields that change the summation order (measured and reported, never cached "
                             "when the bits differ)")
    parser.add_argument("--warmup", type=int, default=SearchOptions.warmup)
    parser.add_argument("--reps", type=int, default=SearchOptions.reps)
    parser.add_argument("--rounds", type=int, default=SearchOptions.rounds, help="rounds of alternating order")
    parser.add_argument("--confirm-rounds", type=int, default=SearchOptions.confirm_rounds,
                        help="rounds of alternating order of the confirmation run")
    parser.add_argument("--no-neighbours", action="store_true",
                        help="measure only the model's top points and the default, not the one-stage neighbours "
                             "of its best")
    parser.add_argument("--min-gain", type=float, default=SearchOptions.min_gain,
                        help="a point replaces the default only if at least this much faster (fraction)")
    parser.add_argument("--schedule", choices=("fused", "sequential"), default="fused")
    parser.add_argument("--constants", default="", help="the model's hardware constants (tuning.calibrate --out)")
    parser.add_argument("--cache", default=None, help=f"the cache file to merge into (default {default_cache_path()})")
    parser.add_argument("--json-out", default=None, help="append one JSON line per shape")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def requested_layers(parser: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> list[MoELayer]:
    """The layers the command line asks for on ``world`` ranks (``--config``
    or ``--shape``, with ``--dtype``, ``--score-before`` and ``--weight-grad-dtype``)."""
    if args.config:
        layers, ep_degree = config_layers(args.config, world)
        if ep_degree != world:
            parser.error(f"--config {args.config} sets parallelism.expert_parallel_degree = {ep_degree}, but this "
                         f"run has {world} process(es): run torchrun --nproc_per_node {ep_degree} -m "
                         "titan_uniep.tools.tune --config ...")
    else:
        dtype = DTYPES[args.dtype or "bf16"]
        layers = [MoELayer(name, *dims, args.score_before, dtype) for name, dims in args.shapes]
    if args.weight_grad_dtype != "auto":
        grads = torch.float32 if args.weight_grad_dtype == "float32" else None
        layers = [dataclasses.replace(layer, weight_grad_dtype=grads) for layer in layers]
    return layers


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.shapes) == bool(args.config):
        parser.error("give --shape (one or more) or --config, not both")
    if args.top < 0 or args.rounds < 1 or args.confirm_rounds < 1 or args.reps < 1 or not 0 <= args.min_gain < 1:
        parser.error("--top >= 0, --rounds >= 1, --confirm-rounds >= 1, --reps >= 1 and 0 <= --min-gain < 1")
    if not torch.cuda.is_available():
        # One line, before any CUDA call: without a GPU, init_group's set_device fails deep in torch.
        parser.exit(2, f"{PROG}: error: the measured search times CUDA kernels: it needs a CUDA GPU. Without one, "
                       "train with [uniep] tuning = \"off\" (the shipped defaults) or \"cached\" with a cache "
                       "tuned on a GPU of the same model\n")
    group, dev = init_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = requested_layers(parser, args, world)
    options = SearchOptions(top=args.top, numerics=args.numerics, warmup=args.warmup, reps=args.reps,
                            rounds=args.rounds, confirm_rounds=args.confirm_rounds, min_gain=args.min_gain,
                            neighbours=not args.no_neighbours, schedule=args.schedule, constants=args.constants,
                            progress=not args.no_progress)
    path = args.cache or default_cache_path()
    results = []
    for layer in layers:
        start = time.monotonic()
        res = search_layer(group, layer, options)
        seconds = time.monotonic() - start
        results.append(res)
        if rank == 0:
            print_result(res)
            print(f"{layer.name}: searched in {seconds:.1f} seconds", flush=True)
            if res.entry is not None:  # after every shape: a run cut short keeps what it measured
                save(path, [res.entry])
                print(f"wrote the entry of {layer.name} into {path}", flush=True)
            if args.json_out:
                with open(args.json_out, "a") as f:
                    f.write(json.dumps({"shape": layer.name, "dims": layer.dims, "world": world, "seconds": seconds,
                                        "weight_grad_dtype": dtype_name(layer.weight_grad_dtype or layer.dtype),
                                        "table": res.table, "problems": res.problems,
                                        "violations": res.violations,
                                        "entry": res.entry and res.entry.to_json()}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    if any(res.violations for res in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
