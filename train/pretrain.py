"""`make pretrain CONFIG=...`: V-JEPA pretraining of a 3D ViT on the local OCT cache.

One loop for cpu, cuda (torchrun + DDP) and xla (SPMD). Resumes automatically from the run's
latest checkpoint; a run killed at step k and resumed reaches the same weights as one that
was never interrupted (bit for bit on CPU in float32).
"""
from __future__ import annotations

import argparse
import copy
import functools
import time
from pathlib import Path
from typing import Sequence

import torch
import yaml

from octfm import cli, config, fsio, procs
from octfm.config import ConfigError
from train import (batching, checkpoint, data, masks, metrics, online_probe, resident, run_folder, runtime, schedule,
                   shares)
from train.config import TrainConfig, per_process_batch
from train.loop import TrainLoop
from train.model import JEPA, objective, target_features
from train.run_folder import RunFolder
from train.startup import Startup
from train.checkpoint import to_cpu
from train.ema import ema_update
from train.optim import build_optimizer, guarded_step, load_optimizer
from train.runtime import compile_modules


class Trainer(TrainLoop):
    """Holds the state that a checkpoint captures; `run` (TrainLoop) runs `_loop`."""

    def __init__(self, cfg: TrainConfig, rt: runtime.Runtime, ckpt: str | None = None):
        self.cfg = cfg
        run_dir = Path(cfg.runs_dir) / cfg.name
        super().__init__(rt, run_dir, cfg.ckpt_dir or run_folder.default_checkpoints(run_dir), cfg.name,
                         cfg.optim.spike_factor)
        checkpoint.require_shared(self.ckpt_dir, rt.hosts)
        torch.manual_seed(cfg.seed)
        self.rows = data.select_rows(cfg.data.cache, cfg.data.splits, cfg.data.scanners)
        if not self.rows:
            raise cli.UsageError(f"data: no ok volumes in {cfg.data.cache} for splits {cfg.data.splits} "
                                 f"and scanners {cfg.data.scanners}")
        self.split = batching.split(cfg.global_batch, cfg.chip_batch, rt.chips, rt.world, rt.hosts)
        self.shares, self.sizes = shares.run_shares(cfg, self.rows, rt.host, rt.hosts)
        self.epoch_len = shares.epoch_length([len(s) for s in self.shares], self.split.per_process * rt.local_world)
        self.resident = None  # the training volumes on the device (data.resident), loaded when the loop starts
        self.on_device: bool | None = None  # whether this run crops resident volumes: decided once (wants_resident)
        if data.loader_workers(cfg.data.workers) > 0:
            procs.worker_context(cfg.data.start_method)  # the loader's process server preloads while the model builds
        self.grid = masks.grid_for(cfg.data.input_shape, cfg.model.tubelet)
        self.mask_sizes = masks.calibrate(self.grid, cfg.mask, seed=cfg.seed)
        self.model = JEPA(cfg.model, cfg.data.input_shape, cfg.loss)
        self.target = copy.deepcopy(self.model.encoder).requires_grad_(False)
        self.model.to(rt.device)
        self.target.to(rt.device)
        if cfg.compile and rt.kind != "xla":
            compile_modules(self.target)  # the student after the DDP wrap: network()
        self.horizon = cfg.max_steps  # the step the schedules end at: a resume keeps the checkpoint's
        self.lr = torch.tensor(schedule.learning_rate(0, self.horizon, cfg.optim), device=rt.device)
        self.momentum = torch.tensor(cfg.optim.ema[0], device=rt.device)
        self.opt = build_optimizer(self.model, cfg, rt, self.lr)
        self.consumed = 0  # batches drawn per process: the data position
        self._val = None   # (val row count, loader), built at the first validation
        self._probe = None  # the online probe, built at its first use
        self.resumed_from = self._resume(ckpt)
        # the constant buffers (positions) too: left unmarked, the first step read them without a sharding
        # and XLA gave them one after it, so the second step compiled another graph (docs/accelerators.md)
        rt.replicate([*self.state_tensors(), *self.model.buffers(), *self.target.buffers()])

    @property
    def total(self) -> int:
        return self.cfg.max_steps

    @property
    def keep_last(self) -> int | None:
        return self.cfg.keep_last

    def state_tensors(self) -> list[torch.Tensor]:
        """Every device tensor a step reads and writes back: weights, AdamW state, the device scalars."""
        opt_state = [v for st in self.opt.state.values() for v in st.values() if torch.is_tensor(v)]
        scalars = [self.lr, self.momentum, self.clock, *self.guard.tensors()]
        return [*self.model.parameters(), *self.target.parameters(), *opt_state, *scalars]

    # ------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        return to_cpu({
            "model": self.model.state_dict(), "target": self.target.state_dict(), "optimizer": self.opt.state_dict(),
            "schedule": {"horizon": self.horizon},
            "data_position": shares.share_position(self.consumed, self.sampler(), self.rt.hosts),
            "step": self.step, "consumed_batches": self.consumed, **self.guard.state(),
            "rng": checkpoint.rng_state(), "config": config.to_dict(self.cfg), "world": self.rt.world,
            "resident": self.on_device,
        })

    def _resume(self, ckpt: str | None) -> str | None:
        """From CKPT, which must load, or else from the run's newest checkpoint (TrainLoop.newest_checkpoint)."""
        found = self.newest_checkpoint(ckpt)
        if found is None:
            return None
        uri, st = found
        self.model.load_state_dict(st["model"])
        self.target.load_state_dict(st["target"])
        load_optimizer(self.opt, st["optimizer"], self.lr)
        self.step = int(st["step"])
        self.consumed = self._resume_position(uri, st)
        self.horizon = self._resume_horizon(st)
        self.guard.load_state(st)
        checkpoint.set_rng_state(st["rng"])
        self.on_device = resident.on_resume(self.cfg.data.resident, st["resident"], self.rt.device,
                                            print if self.rt.is_master else lambda _: None)
        return uri

    def _resume_position(self, uri: str, st: dict) -> int:
        """The checkpoint's place in the data, converted to this run's batch split (global batch,
        processes, hosts: shares.start_for); refused when no whole number of this run's micro-steps
        reaches it."""
        rt, lay, pos = self.rt, self.split, st["data_position"]
        old_world = int(st["world"])
        old_batch = int(per_process_batch(st["config"], old_world)["global_batch"])
        start, note = shares.start_for(pos, self.sampler(), rt.hosts)
        if start is None:
            g = lay.per_process * rt.local_world
            raise cli.UsageError(
                f"{uri}: it stopped {pos['offset']} samples into epoch {pos['epoch']} of each host's share (global batch "
                f"{old_batch} on {old_world} process(es)); global batch {lay.global_batch} on {rt.world} process(es) "
                f"draws {g} a host per micro-step, which does not divide {pos['offset']}: resume with a global batch "
                f"that does (e.g. the checkpoint's), or from a checkpoint at an epoch boundary")
        if rt.is_master and note:
            print(f"resume: {note}")
        elif rt.is_master and (old_batch, old_world) != (lay.global_batch, rt.world):
            print(f"resume: global batch {old_batch} on {old_world} process(es) -> {lay.global_batch} on {rt.world}: "
                  f"the data continues at epoch {pos['epoch']}, sample {pos['offset']} of each host's order")
        return start

    def _resume_horizon(self, st: dict) -> int:
        """The schedules' end step as first set. Raising max_steps extends the run with a constant
        tail at final_lr and the last EMA momentum; lowering it stops the run early with the
        schedules unchanged."""
        cfg = self.cfg
        horizon = int(st["schedule"]["horizon"])
        if cfg.max_steps != horizon and self.rt.is_master:
            if cfg.max_steps > horizon:
                print(f"resume: max_steps {horizon} -> {cfg.max_steps}: the schedules end at step {horizon}; steps "
                      f"{max(horizon, self.step)}..{cfg.max_steps} run at optim.final_lr {cfg.optim.final_lr:g} and "
                      f"EMA momentum optim.ema[1] {cfg.optim.ema[1]:g} (a constant tail; the schedule never restarts)")
            else:
                print(f"resume: max_steps {horizon} -> {cfg.max_steps}: the run stops at step {cfg.max_steps}; the "
                      f"schedules keep their horizon {horizon}")
        return horizon

    def network(self) -> torch.nn.Module:
        """The student as the step calls it: wrapped for DDP, then compiled (`compile: true`)."""
        net = self.rt.wrap(self.model)
        if self.cfg.compile and self.rt.kind != "xla":
            compile_modules(net)
        return net

    def saved(self, log: metrics.MetricsLog, path: str | None, step: int) -> None:
        """After a checkpoint is down (rank 0): W&B hears of it, and a checkpoint folder kept outside
        the run folder gets the metrics so far (run_folder.publish)."""
        log.log_checkpoint(path, step=step)
        run_folder.publish(self.run_dir, self.ckpt_dir, run_folder.METRICS)

    # ------------------------------------------------------------ data
    def share_line(self) -> str:
        """Which volumes each host reads, for the start line."""
        rt, counts = self.rt, [len(s) for s in self.shares]
        if rt.hosts == 1:
            return (f"one host: every process of it draws from all {len(self.rows)} training volumes, "
                    f"{self.epoch_len} per epoch")
        line = (f"{rt.hosts} hosts, each reading its own share of the {len(self.rows)} training volumes "
                f"({', '.join(map(str, counts))} volumes; {self.epoch_len} a host per epoch)")
        if self.sizes:
            held = [sum(self.sizes[self.rows[i]["volume"]] for i in s) for s in self.shares]
            line += f", {' / '.join(f'{b / 1e9:.2f}' for b in held)} GB of {sum(held) / 1e9:.2f} GB"
        return line

    def sampler(self, start_batch: int = 0, stop_batch: int | None = None) -> shares.ShareSampler:
        """This process's stream of the training data: its host's share (train/shares.py)."""
        rt = self.rt
        return shares.ShareSampler(self.shares[rt.host], self.epoch_len, self.split.per_process,
                                   rt.local_rank, rt.local_world, self.cfg.seed,
                                   start_batch, stop_batch)

    def train_loader(self, start_batch: int = 0, stop_batch: int | None = None, volumes: bool = True,
                     worker_log: str | None = None):
        """(sampler, loader) of the training batches from micro-step `start_batch` to `stop_batch`."""
        sampler = self.sampler(start_batch, stop_batch)
        return sampler, self.loader(self.rows, sampler, True, self.cfg.seed, volumes, worker_log)

    def loader(self, rows, sampler, augment: bool, seed: int, volumes: bool = True, worker_log: str | None = None):
        """`volumes` False: batches carry crop boxes for the resident volumes (materialize).
        `worker_log`: each worker notes its start there (data.note_worker_start)."""
        cfg = self.cfg
        ds = data.CacheDataset(rows, cfg.data, cfg.mask, self.grid, self.mask_sizes, seed, augment, volumes)
        return data.batch_loader(ds, self.split.per_process, sampler, cfg.data.workers, cfg.data.start_method,
                                 pin=self.rt.kind == "cuda", prefetch_factor=cfg.data.prefetch_factor,
                                 worker_log=worker_log)

    def materialize(self, batch: dict) -> dict:
        """A batch of crop boxes becomes a batch of crops of the resident volumes."""
        if "box" not in batch:
            return batch
        x = self.resident.crops(batch.pop("index"), batch.pop("box"), batch.pop("flip"), self.cfg.data.input_shape)
        return {"x": x, **batch}

    def wants_resident(self) -> bool:
        """`data.resident`, decided once per run and kept in its checkpoints (resident.on_resume):
        resident only when every process's volumes fit (Runtime.all_true), so no rank takes the
        other path, whose crops differ; never on several hosts, which each read their own share."""
        if self.on_device is None:
            d = self.cfg.data
            if self.rt.hosts > 1:  # the resident tensor holds every training volume; each host holds its share
                if d.resident == "always":
                    raise ConfigError(f"data.resident: always loads all {len(self.rows)} training volumes on every "
                                      f"process, but each of the {self.rt.hosts} hosts reads only its share: set "
                                      f"data.resident=never (auto keeps the loader on several hosts)")
                self.on_device = False
            else:
                self.on_device = self.rt.all_true(resident.wanted(d.resident, self.rt.device, self.rows, d.stride))
        return self.on_device

    def load_resident(self, progress: bool) -> None:
        d = self.cfg.data
        self.resident = resident.ResidentVolumes(d.cache, self.rows, d.stride, self.rt.device, progress)

    # ------------------------------------------------------------ one update
    def update(self, batches, net) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward/backward over the micro-batches, clip, guard, step, EMA; no host sync.

        The update guard (train/guard.py) reads only global values (the loss is averaged over
        processes first; the grad norm is of DDP's all-reduced gradients), so every process
        decides alike. Returns the global loss."""
        cfg, rt = self.cfg, self.rt
        accum = len(batches)
        loss_sum = torch.zeros((), device=rt.device)
        targets = None
        for i, b in enumerate(batches):
            x = data.normalize(b["x"], b["aug"])
            with rt.autocast():
                targets = target_features(self.target, x)
            with rt.no_sync(net, i < accum - 1), rt.autocast():
                loss = net(x, data.mask_pairs(b), targets)
            (loss / accum).backward()
            loss_sum = loss_sum + loss.detach().float()
        loss = rt.all_mean(loss_sum / accum)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)  # pre-clip norm
        ok = self.guard.accepts(loss, grad_norm)
        guarded_step(self.opt, ok)
        # momentum 1 on a skip: target + 0 * (online - target), exact (the online weights are finite)
        ema_update(self.target, self.model.encoder, torch.where(ok, self.momentum, torch.ones_like(self.momentum)))
        self.opt.zero_grad(set_to_none=True)
        self.guard.record(ok, loss)
        return loss, grad_norm, targets

    def write_schedules(self, clock: torch.Tensor) -> None:
        """This step's learning rate and EMA momentum (TrainLoop.advance_schedules)."""
        self.lr.copy_(schedule.learning_rate(clock, self.horizon, self.cfg.optim))
        self.momentum.copy_(schedule.ema_momentum(clock, self.horizon, self.cfg.optim))

    @torch.no_grad()
    def validate(self) -> dict | None:
        cfg = self.cfg
        if self._val is None:  # built once: the rows are read once and the workers persist
            rows = shares.validation_rows(cfg, data.select_rows(cfg.data.cache, ["val"], cfg.data.scanners))
            b, world = self.split.per_process, self.rt.world
            if len(rows) < b * world:
                self._val = (0, None)
            else:
                sampler = data.EpochSampler(len(rows), b, self.rt.rank, world, cfg.seed + 1, shuffle=False,
                                            stop_batch=cfg.val_batches)
                self._val = (len(rows), self.loader(rows, sampler, augment=False, seed=cfg.seed + 1))
        n_rows, dl = self._val
        if dl is None:
            return None
        it = iter(self.rt.loader(dl))
        n = min(cfg.val_batches, n_rows // (self.split.per_process * self.rt.world))
        if n < 1:  # val_batches: 0
            return None
        total = 0.0  # a Python number until the first loss: a zeros tensor made here was a graph of its own on
        for _ in range(n):  # XLA, run by the loader's sync at the first batch
            b = self.rt.to_device(next(it))
            x = data.normalize(b["x"], b["aug"])
            with self.rt.autocast():
                tg = target_features(self.target, x)
                total = total + self.model(x, data.mask_pairs(b), tg).float()
        loss = self.rt.all_mean(total / n)
        return {"step": self.step, "loss": float(loss)}

    def online_probe(self, log: metrics.MetricsLog, postfix: dict) -> None:
        """Score the EMA target encoder (every process computes it, so XLA SPMD hosts run the
        same graphs; rank 0 logs) and show it in the progress line."""
        if self._probe is None:
            self._probe = online_probe.OnlineProbe(self.cfg, self.rt.device, self.rt.autocast)
            if not self._probe.usable and self.rt.is_master:
                print(f"online probe: no labelled train and val rows in {self.cfg.data.cache}; eval_every is ignored")
        if not self._probe.usable:
            return
        rec = self._probe(self.target, self.step)
        log.log(rec, prefix="probe")
        # the ridge score leads (it tracked the offline probes in the learning check; k-NN did not); k-NN when ridge is off
        kind = "ridge" if any(k.endswith("/ridge_bal_acc") for k in rec) else "knn"
        postfix.update({f"{kind}_{t}": "n/a" if v is None else f"{v:.3f}"
                        for t, v in ((k.split("/")[0], v) for k, v in rec.items() if k.endswith(f"/{kind}_bal_acc"))})

    # ------------------------------------------------------------ the loop
    def _start(self, startup: Startup, log: metrics.MetricsLog, bar, postfix: dict):
        """What runs before the first step, each part a lap of the startup record: the loader
        (its workers start here and import while the volumes load and the probe runs), the
        resident volumes, the step-0 online probe. Returns (sampler, batches), None when the run
        has nothing left to do (the learning check re-enters a finished run: no workers start)."""
        cfg = self.cfg
        todo = self.step < cfg.max_steps
        on_device = todo and self.wants_resident()
        sampler = it = None
        if todo:
            sampler, dl = self.train_loader(self.consumed, self.consumed + (cfg.max_steps - self.step) * self.split.accum,
                                            volumes=not on_device, worker_log=startup.worker_log)
            it = iter(self.rt.loader(dl))
        startup.lap("loader")
        if on_device:
            self.load_resident(progress=not bar.disable)
        startup.lap("resident")
        if cfg.eval_every and self.step == 0 and todo:
            self.online_probe(log, postfix)  # the random-init floor of every probe curve
            bar.set_postfix(postfix, refresh=False)
        startup.lap("online_probe")
        return sampler, it

    def _loop(self, log: metrics.MetricsLog, bar) -> dict:
        cfg, rt = self.cfg, self.rt
        net = self.network()
        startup = Startup(log, show=rt.is_master and not bar.disable)
        postfix: dict = {}
        sampler, it = self._start(startup, log, bar, postfix)
        accum = self.split.accum
        first_loss = last_loss = None
        t_last, wait, samples = time.perf_counter(), 0.0, 0
        self.start_clock()
        while self.step < cfg.max_steps:
            tw = time.perf_counter()
            batches = [self.materialize(rt.to_device(next(it))) for _ in range(accum)]
            wait += time.perf_counter() - tw
            self.advance_schedules()  # after the fetch (XLA's loader ends a graph there): in the step's graph
            loss, gnorm, targets = self.update(batches, net)
            rt.sync()
            self.step += 1
            self.consumed += accum
            samples += cfg.global_batch
            startup.after_step(self.step, loss, wait)
            bar.update(1)
            self.writer.poll()  # a finished write: W&B hears of it, or its error stops the run
            if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                dt = time.perf_counter() - t_last
                rec = self.log_step(log, {
                    "epoch": self.consumed // sampler.batches_per_epoch, "loss": float(loss), "lr": float(self.lr),
                    "grad_norm": float(gnorm), "ema_momentum": float(self.momentum), "samples_per_s": samples / dt,
                    "tokens_per_s": samples * self.grid.tokens / dt, "data_wait_frac": min(1.0, wait / dt),
                    "target_std": metrics.feature_std(targets), "rankme": metrics.rankme(targets, cfg.rankme_tokens)})
                self.guard.check_lockout(cfg.optim.max_consecutive_skips, self.step, self.newest_saved)
                first_loss = rec["loss"] if first_loss is None else first_loss
                last_loss = rec["loss"]
                postfix.update(loss=f"{rec['loss']:.4f}", rankme=f"{rec['rankme']:.1f}")
                bar.set_postfix(postfix, refresh=False)
                t_last, wait, samples = time.perf_counter(), 0.0, 0
            if cfg.val_every and self.step % cfg.val_every == 0:
                v = self.validate()
                if v:
                    log.log(v, prefix="val")
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                self.online_probe(log, postfix)
                bar.set_postfix(postfix, refresh=False)
            if self.step % cfg.ckpt_every == 0 or self.step == cfg.max_steps:
                self.save(on_saved=functools.partial(self.saved, log, step=self.step))
            if any(every and self.step % every == 0 for every in (cfg.ckpt_every, cfg.val_every, cfg.eval_every)):
                t_last, wait, samples = time.perf_counter(), 0.0, 0  # throughput measures training only
        return {"steps": self.step, "first_logged_loss": first_loss, "last_logged_loss": last_loss,
                "skipped_updates": int(self.guard.skipped), "run_dir": str(self.run_dir), "ckpt_dir": self.ckpt_dir}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make pretrain", description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--ckpt", default=None, help="start from this checkpoint instead of the run's latest")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("overrides", nargs="*", help="key=value overrides (make ARGS)")
    a = ap.parse_args(argv)
    cfg = config.load(TrainConfig, a.config, a.overrides)
    rt = runtime.setup(cfg.device, cfg.precision)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, rt, a.ckpt)
    if rt.is_master:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        fsio.atomic_write_bytes(str(RunFolder(trainer.run_dir).config),
                                yaml.safe_dump(config.to_dict(cfg), sort_keys=False).encode())
        run_folder.publish(trainer.run_dir, trainer.ckpt_dir, run_folder.CONFIG)
        where = f"resumed from {trainer.resumed_from} at step {trainer.step}" if trainer.resumed_from else "from scratch"
        print(f"pretrain: {cfg.name} on {rt.kind} x{rt.world}, {len(trainer.rows)} volumes, grid {trainer.grid}, "
              f"tokens ctx/tgt per set {[(s.context_cells * trainer.grid.depth, s.target_cells * trainer.grid.depth) for s in trainer.mask_sizes]}, "
              f"{where}; objective: {objective(cfg.loss)}")
        print(f"pretrain: {trainer.split.describe(trainer.grid.tokens)}")
        print(f"pretrain: {trainer.share_line()}")
    out = trainer.run(progress=not a.no_progress)
    rt.shutdown()
    if rt.is_master:
        from train.curves import plot_metrics

        png = plot_metrics(trainer.run_dir)
        print(f"pretrain: curves in {png}")
        if out["first_logged_loss"] is None:
            print(f"pretrain: nothing to do: the run is at step {trainer.step} of max_steps={cfg.max_steps} "
                  f"(raise max_steps to train on at the schedules' final values, or change name= to start a new "
                  f"run); checkpoints {out['ckpt_dir']}")
        else:
            print(f"pretrain: {out['steps']} steps in {time.perf_counter() - t0:.1f}s; logged loss "
                  f"{out['first_logged_loss']} -> {out['last_logged_loss']}; skipped updates {out['skipped_updates']}; "
                  f"metrics {out['run_dir']}/metrics.jsonl; checkpoints {out['ckpt_dir']}")
    return 0


if __name__ == "__main__":
    cli.run(main)
