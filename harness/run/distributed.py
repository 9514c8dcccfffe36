"""Data-parallel training of one run under ``torchrun``: process group, ranks, reductions.

``torchrun --nproc_per_node=N`` starts N copies of the command and tells each its place
through the environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``). :func:`process_group`
joins them (gloo on CPU, nccl on CUDA with one device per local rank) for the length of a
run and leaves again, also on error. Without torchrun, or with one process, nothing here
starts a group and every helper is the identity, so single-process runs are untouched.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from modbench.errors import ModbenchError
from modbench.variants import StepMean


def launched_world_size() -> int:
    """Processes torchrun started for this run (1 without torchrun); valid before any group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_distributed() -> bool:
    """True inside :func:`process_group` with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank: from the group when joined, else from torchrun's environment.

    The environment fallback keeps ``is_main`` right after the group is torn down (the CLI
    prints the summary then).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """Rank 0: the one process that prints, tracks and writes files."""
    return rank() == 0


def check_batch_size(batch_size: int) -> None:
    """The global batch must split evenly into one contiguous slice per process."""
    n = launched_world_size()
    if batch_size % n:
        lower, upper = batch_size // n * n, (batch_size // n + 1) * n
        options = f"{lower} or {upper}" if lower else str(upper)
        raise ModbenchError(
            f"train.batch_size {batch_size} is the global batch and must be divisible by the "
            f"{n} torchrun processes: use a multiple of {n}, e.g. {options}"
        )


@contextmanager
def process_group(device: torch.device) -> Iterator[torch.device]:
    """Join torchrun's process group for the duration of a run; yields this rank's device.

    A group that already exists (a caller's own) is used and left for the caller to end.
    On CUDA each process takes ``cuda:LOCAL_RANK``.
    """
    n = launched_world_size()
    if n <= 1 or (dist.is_available() and dist.is_initialized()):
        yield _local_device(device) if n > 1 else device
        return
    if not dist.is_available():
        raise ModbenchError("this torch build has no torch.distributed: run without torchrun")
    device = _local_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, **kwargs)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def _local_device(device: torch.device) -> torch.device:
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise ModbenchError(
            f"torchrun started local rank {local} but this machine has {torch.cuda.device_count()} "
            f"CUDA devices: use --nproc_per_node <= {torch.cuda.device_count()}"
        )
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def local_slice(batch: Tensor) -> Tensor:
    """This rank's contiguous share of a global batch (dim 0); the whole batch alone."""
    n = world_size()
    if n == 1:
        return batch
    share = batch.shape[0] // n
    r = rank()
    return batch[r * share : (r + 1) * share]


def mean_over_ranks(value: Tensor) -> Tensor:
    """Element-wise mean of a tensor over all ranks (the tensor itself alone)."""
    if not is_distributed():
        return value
    out = value.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()


def broadcast_float(value: float) -> float:
    """Rank 0's value on every rank (decisions that must agree, e.g. a time budget)."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    dist.broadcast(t, src=0)
    return float(t.item())


def broadcast_object(obj: Any) -> Any:
    """Rank 0's (picklable) object on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=_collective_device())
    return box[0]


def average_buffers(modules: Iterable[nn.Module]) -> None:
    """Replace every floating-point buffer of ``modules`` by its mean over ranks, in place; state kept
    equal on every rank at every step (submodules marked ``rank_equal``: budget controllers,
    expert_threshold's threshold, see :func:`sync_step_statistics`) is left bit for bit as it is."""
    if not is_distributed():
        return
    for module in modules:
        for sub in module.modules():
            if getattr(sub, "rank_equal", False):
                continue
            for buf in sub.buffers(recurse=False):
                if buf.is_floating_point():
                    buf.copy_(mean_over_ranks(buf))


def sync_step_statistics(model: nn.Module) -> None:
    """Average every ``StepMean`` of ``model`` over ranks: one all-reduce per step, after the last
    micro-batch. The per-step state the training forward reads (a budget controller's bias,
    expert_threshold's threshold) is then updated from the same numbers on every rank in the
    per-step hook (``GPT.set_step``), so it stays equal across ranks without being broadcast: the
    slices are equal, so the mean of the slice means is the global batch's, as one process sees it."""
    if not is_distributed():
        return
    stats = [m for m in model.modules() if isinstance(m, StepMean)]
    if not stats:
        return
    mean = mean_over_ranks(torch.stack([m.total for m in stats]))
    for m, value in zip(stats, mean.unbind()):
        m.total.copy_(value)


def _collective_device() -> torch.device:
    # nccl moves only CUDA tensors; gloo takes CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wrap_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` wrapped in DistributedDataParallel inside a group, else ``model`` itself.

    Buffers are not synchronised in the forward pass. The routers' running means (causal
    thresholds, linear_softmax's log Ẑ) are read by no training forward: each rank keeps the
    running mean of its own slices and the trainer calls :func:`average_buffers` on the routers
    before saving; the update is linear in the observed batch mean and the rates depend only on
    the step, so that average is the single-process running mean of the global batches
    (broadcasting rank 0's buffers would keep the statistic of rank 0's slices only). The final
    calibration (rank 0, whole batches) resets them anyway. The state a training forward *does*
    read (budget controllers, expert_threshold's threshold) moves once per step from statistics
    averaged over ranks (:func:`grad_sync`, :func:`sync_step_statistics`), so it is equal on every
    rank at every forward.
    """
    if not is_distributed():
        return model
    from torch.nn.parallel import DistributedDataParallel

    # forward_sync_buffers=False (torch >= 2.13; broadcast_buffers is deprecated) still syncs
    # the buffers once at construction, which is harmless: every rank built the same ones.
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   forward_sync_buffers=False)


def grad_sync(step_model: nn.Module, last_micro: bool) -> AbstractContextManager:
    """All-reduce gradients only after the last micro-batch of a step (DDP ``no_sync``); after that
    micro-batch's backward, also the step's router statistics (:func:`sync_step_statistics`): the one
    point every rank passes once per step (``GPT.set_step`` is also called on rank 0 alone, to count
    FLOPs, so it cannot hold a collective)."""
    if not hasattr(step_model, "no_sync"):
        return nullcontext()
    if not last_micro:
        return step_model.no_sync()
    return _then(sync_step_statistics, step_model.module)


@contextmanager
def _then(fn, *args) -> Iterator[None]:
    yield
    fn(*args)
