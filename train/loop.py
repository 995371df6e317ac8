"""What pretraining (train/pretrain.py) and fine-tuning (evals/finetune.py) share around their own
loops: the checkpoint a run resumes from and its saves in the background, the device step clock
that the schedules read, the update guard, the metrics log's step record, and the run itself with
its progress bar. Each trainer keeps its own loop, `update`, validation and checkpoint state.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

from octfm import config, fsio
from train import checkpoint, metrics, runtime
from train.guard import UpdateGuard
from train.metrics import xla_compiles
from train.schedule import set_scalar


class TrainLoop:
    """A subclass sets `cfg` (with `log_every` and `wandb`), `total` (the step its loop ends at)
    and `keep_last`, and writes `state()`, `write_schedules(clock)` and `_loop(log, bar)`."""

    def __init__(self, rt: runtime.Runtime, run_dir: Path, ckpt_dir: str, desc: str,
                 spike_factor: float | None = None):
        self.rt, self.run_dir, self.ckpt_dir, self.desc = rt, Path(run_dir), ckpt_dir, desc
        self.step = 0
        self.clock = torch.zeros((), device=rt.device)  # self.step on the device, which the schedules read
        self.guard = UpdateGuard(rt.device, spike_factor)
        self.writer = checkpoint.Writer()  # rank 0's checkpoint writes, in the background

    # ------------------------------------------------------------ checkpoints
    def newest_checkpoint(self, ckpt: str | None = None) -> tuple[str, dict] | None:
        """`ckpt` when given (it must load); otherwise the run's newest checkpoint that reads back
        whole, once rank 0 has removed what saves a kill interrupted. None: the run starts afresh."""
        if ckpt:
            return ckpt, checkpoint.load(ckpt)
        if self.rt.is_master:
            fsio.remove_stale_temps(self.ckpt_dir)
        return checkpoint.load_newest_good(self.ckpt_dir, warn=print if self.rt.is_master else lambda _: None)

    def position(self) -> int:
        """The number this run's checkpoints are saved under."""
        return self.step

    def save(self, on_saved=None) -> str | None:
        """Snapshot the state now (state() copies every tensor) and write it in the background
        (checkpoint.Writer) while training goes on. The write before it is waited for first, so
        at most one snapshot is held. Every process takes the snapshot where it is a collective
        (Runtime.collective_snapshot); rank 0 writes it. Returns the path the file will have
        (rank 0); `on_saved(path)` runs once it exists."""
        if not (self.rt.is_master or self.rt.collective_snapshot):
            return None
        snapshot = self.state()
        if not self.rt.is_master:
            return None
        self.writer.wait()
        return self.writer.submit(snapshot, self.ckpt_dir, self.position(), self.keep_last, done=on_saved)

    def newest_saved(self) -> str | None:
        """The newest whole checkpoint once the write in flight is down (every process calls it)."""
        self.writer.wait()
        self.rt.barrier()
        return checkpoint.newest_whole(self.ckpt_dir, warn=lambda _: None)

    # ------------------------------------------------------------ the step
    def start_clock(self) -> None:
        """Once per loop, right before its first step (a resume starts mid-schedule); from then on
        the clock advances on the device."""
        set_scalar(self.clock, self.step)

    @torch.no_grad()
    def advance_schedules(self) -> None:
        """Write this step's schedule values from the device clock (write_schedules), then advance
        it: device ops only, no host copy or sync, one XLA graph for every step."""
        self.write_schedules(self.clock)
        self.clock.add_(1)

    def log_step(self, log: metrics.MetricsLog, record: dict) -> dict:
        """The step's train record: `record`, the update guard's counts (read on the host: at
        log steps only) and on XLA the compilations so far."""
        rec = {"step": self.step, **record, "skipped_updates": int(self.guard.skipped),
               "consecutive_skips": int(self.guard.skip_run)}
        if self.rt.kind == "xla":
            rec.update(xla_compiles())
        log.log(rec)
        return rec

    # ------------------------------------------------------------ the run
    def run(self, progress: bool = True):
        """`_loop` with the metrics log and the progress bar; the last checkpoint is written before
        it returns (an error exit waits for it too)."""
        log = metrics.MetricsLog(self.run_dir, self.rt.is_master, self.cfg.wandb, config.to_dict(self.cfg))
        bar = tqdm(total=self.total, initial=self.step, desc=self.desc, unit="step",
                   disable=not (progress and self.rt.is_master), file=sys.stderr, dynamic_ncols=True)
        try:
            out = self._loop(log, bar)
            self.writer.wait()  # the last checkpoint is down before the run says it is done,
            self.rt.barrier()   # and no process leaves before it is
            return out
        finally:
            try:
                self.writer.wait()  # an error exit too: the write in flight finishes, or says why not
            finally:
                bar.close()
                log.close()
