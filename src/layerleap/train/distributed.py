"""Data-parallel training with ``torch.distributed`` (DDP's scheme, by hand on the few trainable
tensors): ``torchrun --nproc-per-node N -m layerleap train ...`` starts N processes; each takes its
share of every step's batch (``Ranks.share``), computes the gradient of its share's part of the
loss, and the gradients are summed over the processes (all-reduce) before the same optimizer step
on every one.  The weights start equal (broadcast from rank 0) and stay equal; only rank 0 writes
files (checkpoints, weights, reports).

Backend: gloo on the CPU, NCCL on CUDA.  A process started without torchrun (no ``WORLD_SIZE`` in
the environment, or 1) trains alone and nothing here costs anything.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Whether this process writes files (rank 0)."""
        return self.rank == 0

    def threads(self) -> int:
        """Torch threads per process by default: the cores shared out among the processes."""
        return max(1, (os.cpu_count() or 1) // self.world)

    def share(self, items: list) -> tuple[list, float]:
        """This process's items of a step's batch (every ``world``-th from ``rank``) and the weight of
        its part of the batch's mean loss (``len(mine) / len(items)``)."""
        mine = items[self.rank :: self.world]
        return mine, len(mine) / max(1, len(items))


def ranks() -> Ranks:
    """This process's rank and the number of processes (0 of 1 without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    return Ranks()


def init_from_env(device: torch.device | str = "cpu") -> Ranks:
    """Join the process group torchrun describes in the environment (gloo on the CPU, NCCL on CUDA);
    a process started alone stays alone."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return Ranks()
    if not dist.is_initialized():
        cuda = torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        atexit.register(lambda: dist.destroy_process_group() if dist.is_initialized() else None)
    return ranks()


def broadcast(tensors) -> None:
    """Rank 0's values of ``tensors`` on every process."""
    import torch.distributed as dist

    if ranks().world > 1:
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t.data, 0)


def sum_gradients(tensors) -> None:
    """Each tensor's gradient summed over the processes (a missing gradient counts as zero)."""
    import torch.distributed as dist

    if ranks().world <= 1:
        return
    for t in tensors:
        if t.grad is None:
            t.grad = torch.zeros_like(t)
        dist.all_reduce(t.grad)


def sum_value(value: float) -> float:
    """A float summed over the processes."""
    import torch.distributed as dist

    if ranks().world <= 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return float(t)
