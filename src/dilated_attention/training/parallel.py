"""How a training step is split across processes started by ``torchrun``.

- one process: the whole batch;
- data parallel (the default with several processes): rank ``k`` takes the ``k``-th
  slice of the batch's sequences, and ``DistributedDataParallel`` averages gradients;
- sequence parallel: every rank takes the ``k``-th contiguous shard of every
  sequence, the model's attention exchanges rows through ``process_group``, and the
  gradients (each rank's part of the sum) are summed.

Either way a step computes the same loss and gradients as one process given the same
global batch, up to float rounding, where the model has no dropout (its embedding and
residual dropout masks come from each process's own generator).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from ..tools.errors import describe
from ..utils.devices import device_type

T = TypeVar("T")


@dataclass
class Parallel:
    """This process's place: ``rank`` of ``world``, ``mode`` ``"single"``, ``"data"`` or ``"sequence"``."""

    rank: int = 0
    world: int = 1
    mode: str = "single"
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # setup() joined the process group, so close() leaves it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def group(self):
        return dist.group.WORLD if self.mode == "sequence" else None

    def part(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows (data parallel) or positions (sequence parallel) of ``(B, N)`` tensors."""
        dim = {"single": None, "data": 0, "sequence": 1}[self.mode]
        if dim is not None:
            inputs, targets = (t.tensor_split(self.world, dim=dim)[self.rank] for t in (inputs, targets))
        return inputs.to(self.device), targets.to(self.device)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over ranks (itself with one process)."""
        if self.world > 1:
            value = value.clone()
            dist.all_reduce(value)
        return value

    def close(self) -> None:
        """Leave the process group if :func:`setup` joined it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def gather(self, value) -> list:
        """Every rank's ``value`` (picklable), by rank."""
        if self.world == 1:
            return [value]
        values: list = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def agree(self, fn: Callable[[], T]) -> T:
        """``fn()`` on every rank. Where it raises a ``ValueError``, ``TypeError`` or
        ``OSError`` on some rank, every rank raises a ``ValueError`` with the first such
        rank's message (a collective), so that all ranks stop alike: a rank left
        waiting in the next collective would end with gloo's traceback instead."""
        result, error = None, None
        try:
            result = fn()
        except (ValueError, TypeError, OSError) as exc:
            if self.world == 1:
                raise
            error = describe(exc)
        if self.world > 1:
            errors = self.gather(error)
            failed = [rank for rank, message in enumerate(errors) if message is not None]
            if failed:
                message = errors[failed[0]]
                alike = all(errors[rank] == message for rank in range(self.world))
                raise ValueError(message if alike else f"process {failed[0]} of {self.world}: {message}")
        return result  # type: ignore[return-value]

    def on_main(self, fn: Callable[[], T]) -> T | None:
        """``fn()`` on rank 0 only (the run folder's writes): its result there, ``None``
        elsewhere. What it raises is raised on every rank (a collective), so that all
        ranks stop alike: on rank 0 as it is, on the others as a ``ValueError`` with its
        message."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except Exception as exc:
                if self.world == 1:
                    raise
                error = exc
        if self.world > 1:
            shared = [None if error is None else describe(error)]
            dist.broadcast_object_list(shared, src=0)
            if error is not None:
                raise error
            if shared[0] is not None:
                raise ValueError(shared[0])
        return result

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module to call in training: ``DistributedDataParallel`` for data parallel."""
        if self.mode != "data":
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def loss_weight(self, global_count: int) -> float:
        """The factor on a rank's summed loss whose gradient, after DDP's average or the
        sequence-parallel sum, is the gradient of the global mean loss."""
        return (self.world if self.mode == "data" else 1) / global_count

    def finish_gradients(self, model: torch.nn.Module) -> None:
        """Sequence parallel: sum the ranks' parts of every gradient."""
        if self.mode != "sequence" or self.world == 1:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))


def launched_processes() -> int:
    """How many processes ``torchrun`` started for this run (its ``WORLD_SIZE``; 1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup(sequence_parallel: bool, device: str | None, asked_by: str = "--sequence-parallel") -> Parallel:
    """Join the process group ``torchrun`` describes in the environment (if any), and
    pick this rank's device (``cuda:LOCAL_RANK`` on GPUs). ``asked_by``: what asked
    for ``sequence_parallel``, in the error where one process cannot do it."""
    world = launched_processes()
    kind = device_type(device, "device")
    if world == 1:
        if sequence_parallel:
            raise ValueError(f"{asked_by} needs several processes: launch with torchrun --nproc_per_node N")
        return Parallel(device=torch.device(kind))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.device(kind).type == "cuda":  # each process its own GPU, whichever was named
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))
    return Parallel(
        rank=rank, world=world, mode="sequence" if sequence_parallel else "data", device=dev, owns_group=owns
    )
