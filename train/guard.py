"""The update guard (docs/recipe.md, Optimisation): an update whose loss or gradient norm is not
finite, or (pretraining) whose loss exceeds spike_factor x the running mean of accepted losses, is
skipped, leaving weights, optimizer state and EMA target exactly as they were (train/optim.py
guarded_step). Its state is three device scalars, read on the host only where the loop already
syncs, and saved in every checkpoint.
"""
from __future__ import annotations

import torch

from octfm import cli


class UpdateGuard:
    """The decision, its running loss mean, the skipped count and the current run of skips in a row.
    `spike_factor` None: finite values alone decide (fine-tuning)."""

    def __init__(self, device: torch.device, spike_factor: float | None = None):
        self.spike_factor = spike_factor
        self.loss_mean = torch.full((), float("inf"), device=device)  # no spike test before a first loss
        self.skipped = torch.zeros((), device=device)
        self.skip_run = torch.zeros((), device=device)  # consecutive skipped updates (the lockout bound)

    def tensors(self) -> list[torch.Tensor]:
        return [self.loss_mean, self.skipped, self.skip_run]

    def accepts(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """A 0-dim bool device tensor. Every process must pass the same (global) loss and grad
        norm, so every process decides alike."""
        ok = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if self.spike_factor is None:
            return ok
        return ok & (loss < self.spike_factor * self.loss_mean)

    def record(self, ok: torch.Tensor, loss: torch.Tensor) -> None:
        """Count the decision and move the running mean on an accepted update: device ops only."""
        if self.spike_factor is not None:
            new_mean = torch.where(torch.isinf(self.loss_mean), loss, 0.9 * self.loss_mean + 0.1 * loss)
            # a new tensor, not written in place: on XLA an in-place write of a tensor the step read before
            # (the decision above) made the second step trace a different graph and compile it again
            # (tests/xla/test_xla.py holds one compilation of the step; docs/accelerators.md)
            self.loss_mean = torch.where(ok, new_mean, self.loss_mean)
        skipped = (~ok).float()
        self.skipped.add_(skipped)
        self.skip_run.copy_((self.skip_run + 1.0) * skipped)

    def state(self) -> dict:
        """The checkpoint's keys (device tensors: the caller copies them, checkpoint.to_cpu)."""
        return {"loss_mean": self.loss_mean, "skipped_updates": self.skipped, "consecutive_skips": self.skip_run}

    def load_state(self, st: dict) -> None:
        self.loss_mean.copy_(st["loss_mean"])
        self.skipped.copy_(st["skipped_updates"])
        self.skip_run.copy_(st["consecutive_skips"])

    def check_lockout(self, limit: int, step: int, newest_checkpoint) -> None:
        """Stop (exit 1) after `limit` skipped updates in a row (0: never). The running mean moves
        only on accepted updates and a skip leaves the weights as they were, so such a run would
        skip for good: a person must decide. Reads the device (call it where the loop syncs);
        `newest_checkpoint()` names the one the next start resumes from."""
        n = int(self.skip_run)
        if not limit or n < limit:
            return
        raise cli.JobAborted(
            f"update guard: the last {n} updates up to step {step} were all skipped "
            f"(optim.max_consecutive_skips={limit}): the loss stayed non-finite or above optim.spike_factor="
            f"{self.spike_factor} x its running mean {float(self.loss_mean):.4g}. Newest whole checkpoint: "
            f"{newest_checkpoint() or 'none yet'} (the next start resumes from it): raise optim.spike_factor to get "
            f"past these steps, or inspect their data and learning rate.")
