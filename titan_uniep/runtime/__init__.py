"""UniEP's host runtime, usable without TorchTitan: the symmetric-memory
workspaces (``workspace``), the launches shared by both directions
(``launch``), the forward (``forward``) and the backward (``backward``)."""

from .backward import moe_backward, simulated_moe_backward
from .forward import exchange_bytes, moe_forward, simulated_moe_forward
from .launch import KERNEL_SCHEDULES
from .workspace import BackwardWorkspace, Workspace, WorkspaceShape, memory_bytes

__all__ = [
    "KERNEL_SCHEDULES",
    "BackwardWorkspace",
    "Workspace",
    "WorkspaceShape",
    "exchange_bytes",
    "memory_bytes",
    "moe_backward",
    "moe_forward",
    "simulated_moe_backward",
    "simulated_moe_forward",
]
