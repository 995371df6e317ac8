"""Learning-rate and EMA-momentum schedules as pure functions of the optimizer step.

A function of the step (not a stateful scheduler object) cannot restart: resuming at step k
gives the value for k. The trainer writes the values into device tensors, because torch_xla
bakes the Python scalars 0 and 1 into graphs (a warmup from 0 or a momentum reaching 1
would recompile).
"""
from __future__ import annotations

import math

from train.config import OptimConfig


def learning_rate(step: int, total: int, cfg: OptimConfig) -> float:
    """Linear warmup from start_lr to lr, then cosine down to final_lr at `total`."""
    if step < cfg.warmup_steps:
        return cfg.start_lr + (cfg.lr - cfg.start_lr) * step / max(1, cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.final_lr + (cfg.lr - cfg.final_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def ema_momentum(step: int, total: int, cfg: OptimConfig) -> float:
    """Linear from ema[0] at the first update to ema[1] at the last (step total - 1)."""
    start, end = cfg.ema
    return start + (end - start) * min(1.0, step / max(1, total - 1))
