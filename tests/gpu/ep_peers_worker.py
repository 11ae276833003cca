"""The EP-group probe of ``titan_uniep.torchtitan.v0_2.parallelize`` on real GPUs (one process per GPU).

Launched by ``test_gpu_ep_peers.py`` as
``torchrun --standalone --nproc_per_node N tests/gpu/ep_peers_worker.py``:
TorchTitan's own mesh (EP = N), the real all-gathers and
``can_device_access_peer``; every GPU of one NVLink host must come back as
one host with full peer access, and the check must pass. Rank 0 prints
``EP PEERS OK``.
"""

import os
import socket

import torch
import torch.distributed as dist
from torchtitan.distributed import ParallelDims

from titan_uniep.config import UniEP
from titan_uniep.torchtitan.v0_2.parallelize import _probe_ep_gpus, check_ep_gpus

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
world = dist.get_world_size()
dims = ParallelDims(dp_shard=-1, dp_replicate=1, cp=1, tp=1, pp=1, ep=world, etp=1, world_size=world)
dims.build_mesh()
gpus = _probe_ep_gpus(dims)
if [g.rank for g in gpus] != list(range(world)) or {g.host for g in gpus} != {socket.gethostname()}:
    raise RuntimeError(f"rank {dist.get_rank()}: probe gave {gpus}")
if any(g.no_peer_access for g in gpus):
    raise RuntimeError(f"rank {dist.get_rank()}: GPUs without peer access on an NVLink host: {gpus}")
check_ep_gpus(UniEP(enable=True, schedule="fused"), gpus)
dist.barrier()
if dist.get_rank() == 0:
    print("EP PEERS OK", flush=True)
dist.destroy_process_group()
