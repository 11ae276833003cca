"""The EP group's GPUs, as the kernel schedules need them; the same on every TorchTitan release.

``probe_ep_gpus`` gathers where every rank of the EP group runs and which
peers its GPU cannot map; ``check_ep_gpus`` refuses a group that the kernel
schedules cannot serve (several hosts, missing peer access), with the same
verdict on every rank. ``one_rank_group`` is a rank's own group: the EP
group of its experts at EP = 1.
"""

from __future__ import annotations

import functools
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_uniep.config import UniEP

__all__ = ["EPGPU", "check_ep_gpus", "one_rank_group", "probe_ep_gpus"]


@dataclass(frozen=True)
class EPGPU:
    """Where one rank of the EP group runs, as every rank of the group sees it."""

    rank: int
    """Global rank."""
    host: str
    no_peer_access: tuple[int, ...]
    """Global ranks on the same host whose GPU this rank's GPU cannot map (``can_device_access_peer``)."""


def probe_ep_gpus(group: dist.ProcessGroup) -> list[EPGPU]:
    """Every EP rank's host and peer access, in EP-rank order (two small all-gathers over ``group``)."""
    world = dist.get_world_size(group)
    device = torch.cuda.current_device()
    visible = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    mine = (dist.get_rank(), socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    places: list = [None] * world
    dist.all_gather_object(places, mine, group=group)
    # A peer GPU this process cannot see (per-rank CUDA_VISIBLE_DEVICES) cannot
    # be probed here; symmetric memory may still reach it through CUDA IPC.
    blocked = tuple(
        rank for rank, host, uuid in places
        if host == mine[1] and uuid != mine[2] and uuid in visible
        and not torch.cuda.can_device_access_peer(device, visible[uuid])
    )
    everyone: list = [None] * world
    dist.all_gather_object(everyone, blocked, group=group)
    return [EPGPU(rank, host, no_access) for (rank, host, _uuid), no_access in zip(places, everyone)]


def check_ep_gpus(cfg: UniEP, gpus: list[EPGPU]) -> None:
    """Raise ValueError unless the kernel schedules can map every EP peer's memory.

    ``sequential`` and ``fused`` store rows straight into the peers' symmetric
    memory (NVLink), so the EP group must sit on one host with peer access
    between every pair of its GPUs; otherwise the failure would come from
    inside the symmetric-memory rendezvous or a kernel. Every rank decides on
    the same gathered picture, so all raise together.
    """
    use_reference = (
        'Use [uniep] schedule = "reference" (torch collectives over any interconnect) for this layout.'
    )
    hosts: dict[str, list[int]] = {}
    for gpu in gpus:
        hosts.setdefault(gpu.host, []).append(gpu.rank)
    if len(hosts) > 1:
        where = "; ".join(f"{host}: ranks {ranks}" for host, ranks in hosts.items())
        raise ValueError(
            f"[uniep] schedule = {cfg.schedule!r} needs the whole EP group on one host (its kernels write into "
            f"the peers' GPU memory over NVLink), but this EP group spans {len(hosts)} hosts ({where}). "
            f"{use_reference} Or set parallelism.expert_parallel_degree to at most the GPUs of one host: "
            "TorchTitan puts consecutive ranks, which torchrun places on one host, in one EP group."
        )
    pairs = [(gpu.rank, peer) for gpu in gpus for peer in gpu.no_peer_access]
    if pairs:
        where = ", ".join(f"rank {a} -> rank {b}" for a, b in pairs)
        raise ValueError(
            f"[uniep] schedule = {cfg.schedule!r} needs peer access between every pair of GPUs in the EP group "
            f"(torch.cuda.can_device_access_peer), but it is missing for {where} on {gpus[0].host}. "
            f"{use_reference} (`nvidia-smi topo -p2p r` shows which GPUs can map each other.)"
        )


@functools.cache
def one_rank_group() -> dist.ProcessGroup:
    """This rank's own process group (a collective the first time: every rank
    creates every rank's group), the EP group of its experts at EP = 1."""
    mine, _all = dist.new_subgroups(group_size=1)
    return mine
