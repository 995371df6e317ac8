"""Learning-rate and EMA-momentum schedules as pure functions of the optimizer step.

A function of the step (not a stateful scheduler object) cannot restart: resuming at step k
gives the value for k. Each takes the step as an int (logs, tests) or as a 0-dim device tensor:
the trainer keeps its step on the device and computes the values there, so a step copies
nothing from the host (a copy from pageable memory waits for the CUDA stream) and torch_xla
traces one graph for every step (Python scalars 0 and 1 would be baked into it: a warmup from
0 or a momentum reaching 1 would recompile). `set_scalar` writes a host value (a resume's step) into
that device clock.
"""
from __future__ import annotations

import math

import torch

from train.config import OptimConfig


def _cos(x):
    return torch.cos(x) if torch.is_tensor(x) else math.cos(x)


def _at_most_one(x):
    return x.clamp(max=1.0) if torch.is_tensor(x) else min(1.0, x)


def _where(cond, a, b):
    """`a if cond else b`; on tensors both sides are computed (one graph), so each must be finite."""
    return torch.where(cond, a, b) if torch.is_tensor(cond) else (a if cond else b)


def warmup_cosine(step, total: int, warmup: int, start: float, peak: float, final: float, offset: int = 0):
    """Linear from `start` at step 0 to `peak` at `warmup`, then cosine down to `final` at `total`
    (held there after). `offset` shifts the warmup ramp only (fine-tuning's first step already
    takes 1/warmup of the peak)."""
    warm = start + (peak - start) * (step + offset) / max(1, warmup)
    progress = _at_most_one((step - warmup) / max(1, total - warmup))
    return _where(step < warmup, warm, final + (peak - final) * 0.5 * (1.0 + _cos(math.pi * progress)))


def learning_rate(step, total: int, cfg: OptimConfig):
    """Linear warmup from start_lr to lr, then cosine down to final_lr at `total`."""
    return warmup_cosine(step, total, cfg.warmup_steps, cfg.start_lr, cfg.lr, cfg.final_lr)


def ema_momentum(step, total: int, cfg: OptimConfig):
    """Linear from ema[0] at the first update to ema[1] at the last (step total - 1)."""
    start, end = cfg.ema
    return start + (end - start) * _at_most_one(step / max(1, total - 1))


def set_scalar(t: torch.Tensor, value: float) -> None:
    """Write a host value into a device tensor as data, never as a graph constant. torch_xla
    bakes the scalars 0 and 1 into graphs, 0-dim host tensors included (a momentum reaching 1
    recompiled); copying a 1-element vector into a view is transferred as data (seen: no
    recompilation for 0.5, 0.7, 1.0, 0.0)."""
    t.view(1).copy_(torch.tensor([value], dtype=t.dtype))
