"""The EMA target encoder's update after each optimizer step (its momentum: train/schedule.py
ema_momentum), on the device with no host read.
"""
from __future__ import annotations

import torch

from train.model import Encoder


@torch.no_grad()
def ema_update(target: Encoder, online: Encoder, momentum: torch.Tensor) -> None:
    """target = m * target + (1 - m) * online, with m a device tensor, read on the device only.

    CUDA and CPU: target += (online - target) * (1 - m) as three foreach ops over every parameter
    (a few fused kernels, not a launch per tensor). `_foreach_lerp_` has no overload for a tensor
    weight: a 0-dim tensor binds to its Scalar one, which reads the weight to the host (a device
    sync every step). On a skipped update m is 1, the product is (+/-)0 and the target stays
    exactly as it was. XLA: one lerp per tensor (torch_xla's foreach lerp reads a tensor weight
    back to the host, which cut the step's graph in two)."""
    w = 1.0 - momentum
    targets, onlines = list(target.parameters()), [o.detach() for o in online.parameters()]
    if w.device.type == "xla":
        for t, o in zip(targets, onlines):
            t.lerp_(o, w)
        return
    moves = torch._foreach_sub(onlines, targets)
    torch._foreach_mul_(moves, w)
    torch._foreach_add_(targets, moves)
