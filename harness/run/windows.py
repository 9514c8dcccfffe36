"""Fixed evaluation windows run through the model in batches (shared by every evaluation)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext

import torch
from torch import Tensor

from modbench import interrupts
from modbench.model.gpt import GPT


def windowed_forward(model: GPT, x: Tensor, y: Tensor, batch_size: int, device: torch.device,
                     autocast: torch.autocast | None = None, **forward_kwargs) -> Iterator[tuple[Tensor, int, object]]:
    """(inputs, first window index, model output) for each batch of fixed eval windows."""
    for i in range(0, x.shape[0], batch_size):
        interrupts.check()  # a long evaluation stops between batches when asked to
        xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
        with autocast or nullcontext():
            out = model(xb, yb, **forward_kwargs)
        yield xb, i, out
