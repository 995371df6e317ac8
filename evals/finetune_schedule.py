"""`make finetune`'s (evals/finetune.py) schedules: the learning-rate factor (warmup, then cosine), the
encoder's own warmup when it unfreezes, and the epochs a step budget leaves; each a function of the
step, an int or a device tensor (train/schedule.py)."""
from __future__ import annotations

import torch

from evals.config import FinetuneConfig
from train import schedule


def lr_factor(step, total: int, warmup: int):
    """Linear warmup over `warmup` steps (the first step at 1/warmup), then cosine from 1 to 0 at
    `total`; `step` an int or a device tensor (schedule.warmup_cosine)."""
    return schedule.warmup_cosine(step, total, warmup, start=0.0, peak=1.0, final=0.0, offset=1)


def thaw_ramp(step, thawed_at: int, warmup: int):
    """The encoder's own warmup once it unfreezes at step `thawed_at`: 1/warmup at that step up to 1
    (its AdamW moments start empty there, so full-size updates would be lr x sign(g) everywhere);
    1 when it trains from the start. `step` an int or a device tensor."""
    if thawed_at <= 0 or warmup <= 0:
        return 1.0
    r = (step - thawed_at + 1) / warmup
    return r.clamp(0.0, 1.0) if torch.is_tensor(r) else min(1.0, max(0.0, r))


def budget_epochs(cfg: FinetuneConfig, per_epoch: int) -> int:
    """The epochs a run trains: `epochs`, or fewer when `max_steps` (a budget in optimizer steps,
    whatever the label fraction) ends it first; never fewer than the frozen epochs plus one."""
    if cfg.max_steps is None:
        return cfg.epochs
    return max(min(cfg.frozen_epochs + 1, cfg.epochs), min(cfg.epochs, -(-cfg.max_steps // max(1, per_epoch))))


def epochs_of(step: int, per_epoch: int) -> int | float:
    """Optimizer steps as epochs: a whole number at an epoch's end, else to two decimals."""
    e = step / per_epoch
    return int(e) if e == int(e) else round(e, 2)
