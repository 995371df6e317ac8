"""`make finetune CKPT=<checkpoint or model folder> [CONFIG=configs/finetune.yaml] [ARGS=...]`.

The EMA target encoder of a pretraining checkpoint (or a `make export` model folder) plus one of
the probes' heads, trained end to end for one task on the train split (optionally a stratified
fraction of its participants), chosen on val balanced accuracy epoch by epoch (early stopping),
scored once on test with the probes' metrics, intervals and plots. `init=random` trains the same
architecture from scratch on the same budget: the baseline a pretrained start must beat.

Layer-wise learning-rate decay (the last block and the final norm at `lr`, each block below it x
`layer_decay`, the patchify lowest), a head learning rate, frozen epochs (the head alone, the
encoder untouched, which then warms up again from its first step), the update guard on non-finite
values, class weights, label smoothing, stochastic depth, warmup and cosine. One loop for cpu,
cuda (torchrun + DDP, bf16) and xla, on pretraining's skeleton (train/loop.py). A killed run
resumes from its last whole epoch to the weights an uninterrupted one reaches. `global_batch` is
the volumes of an optimizer step on any number of processes (each takes its share), so a run
resumed on another process count keeps its steps and continues at its epoch. The best epoch is kept as a checkpoint that `make export`,
`make embed` and `make probe` read like a pretraining one (its head included).

Its parts: the classifier and its layer groups (evals/classifier.py), the labelled rows and their
dataset (evals/finetune_data.py), the schedules (evals/finetune_schedule.py); the curves plot is
train/curves.py plot_history.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from evals import features, probe, probe_heads
from evals import probe_metrics as pm
from evals.backbone import Backbone, load_backbone, training_seed
from evals.classifier import Classifier, layer_groups
from evals.config import FinetuneConfig
from evals.finetune_data import Labelled, training_rows
from evals.finetune_schedule import budget_epochs, epochs_of, lr_factor, thaw_ramp
from manifests.aireadi import TASKS
from octfm import cli, config, fsio
from train import batching, checkpoint, data, encoder, metrics, runtime
from train.checkpoint import to_cpu
from train.curves import plot_history
from train.loop import TrainLoop
from train.metrics import xla_compiles
from train.model import Encoder, set_drop_path
from train.optim import guarded_step, load_optimizer, optimizer_flags
from train.run_folder import RunFolder

RESUME_FREE = ("out", "device", "workers", "eval_batch", "bootstrap", "log_every", "wandb", "precision")  # may change on resume


def run_dir(cfg: FinetuneConfig) -> Path:
    """The run folder: `out`, or runs/finetune_<task>_<init>[_<pct>pct]."""
    if cfg.out:
        return Path(cfg.out)
    pct = "" if cfg.label_fraction == 1 else f"_{round(100 * cfg.label_fraction)}pct"
    return Path("runs") / f"finetune_{cfg.task}_{cfg.init}{pct}"


def saved_split(st: dict) -> dict:
    """A checkpoint's batch split ({batch, world}); "layout" in those written before it was named so."""
    return st.get("batch_split") or st["layout"]


def settings_with_global_batch(saved: dict, world: int) -> dict:
    """A run's saved settings with the per-process `batch_size` of runs made before the fine-tuning
    batch became the global one (on `world` processes) restated as `global_batch`."""
    if "batch_size" not in saved:
        return saved
    out = {k: v for k, v in saved.items() if k != "batch_size"}
    return {**out, "global_batch": int(saved["batch_size"]) * int(world)}


class Finetuner(TrainLoop):
    """The state a checkpoint captures (model, optimizer, epoch, the best val score so far); `run`
    trains what is left of the budget, then scores the best epoch (finish)."""

    keep_last = 1

    def __init__(self, cfg: FinetuneConfig, rt: runtime.Runtime):
        if cfg.task not in TASKS:
            raise cli.UsageError(f"task: unknown task {cfg.task!r} (known: {', '.join(TASKS)})")
        # as pretraining (Trainer): rank 0 alone saves, and every rank resumes from and reads the run folder
        checkpoint.require_shared(str(run_dir(cfg)), rt.hosts, key="out")
        self.cfg = cfg
        self.folder = RunFolder(run_dir(cfg))
        super().__init__(rt, self.folder.root, self.folder.checkpoints(), f"finetune {cfg.task} ({cfg.init})")
        self.spec = TASKS[cfg.task]
        bb = load_backbone(cfg)
        self._read_rows(bb)
        saved = self._saved_state()
        self._build_model(bb.encoder.to(rt.device), saved)
        self._build_optimizer()
        self._plan_budget()
        self.epoch, self.best, self.stale = 0, None, 0  # epoch: whole epochs trained
        self.history: list[dict] = []
        self.resumed = self._resume(*saved) if saved is not None else None

    def _read_rows(self, bb: Backbone) -> None:
        """The start's training config with this run's crop scale and workers, and the labelled rows
        with their classes, splits and the train mask (training_rows)."""
        cfg = self.cfg
        scale = tuple(cfg.scale) if cfg.scale is not None else tuple(bb.train_config.data.scale)
        self.tcfg = dataclasses.replace(bb.train_config, data=dataclasses.replace(
            bb.train_config.data, scale=scale, workers=cfg.workers))
        self.ident = bb.ident
        self.rows, self.train = training_rows(cfg, self.tcfg.data.cache)
        self.y = np.array([self.spec["map"](r["label"]) for r in self.rows])
        self.split = np.array([r["split"] for r in self.rows])
        self._inputs: dict[bytes, list] = {}  # the evaluated rows' cropped volumes, read once (predict)

    def _build_model(self, enc: Encoder, saved: tuple[str, dict] | None) -> None:
        """The encoder and its head: shaped as saved (its weights and scalers load in _resume; no
        start features to recompute), else a fresh head (zeros), behind the train rows' channel
        scalers with `standardize`."""
        cfg = self.cfg
        self.kind = saved[1]["finetune"]["head"] if saved is not None else cfg.head
        torch.manual_seed(training_seed(cfg) + 1)  # the head's weights: the same for both inits
        self.model = Classifier(enc, self.kind, self.spec["classes"], cfg.token_pool).to(self.rt.device)
        if saved is not None:
            self.model.head = probe_heads.shaped_like(self.kind, self.model.head, saved[1]["head"]).to(self.rt.device)
        elif cfg.standardize:
            self.model.head = self.scaled(self.model.head)
        set_drop_path(self.model.encoder, cfg.drop_path)

    def _build_optimizer(self) -> None:
        """AdamW over the layer groups, each with its device lr tensor (write_schedules fills them), and
        the loss's class weights."""
        cfg, rt = self.cfg, self.rt
        self.groups = layer_groups(self.model, cfg)
        self.lrs = [torch.zeros((), device=rt.device) for _ in self.groups]
        self.opt = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"], "lr": lr}
                                      for g, lr in zip(self.groups, self.lrs)], lr=self.lrs[0], **optimizer_flags(rt.kind))
        self.weight = (probe_heads.class_weights(self.y[self.train], self.spec["classes"]).to(rt.device)
                       if cfg.class_weight else None)

    def _plan_budget(self) -> None:
        """The batch per process (its share of `global_batch`, refused where the processes cannot split
        it evenly), the optimizer steps per epoch, the epochs and steps the run trains."""
        # a small cohort's label fraction can hold fewer rows than a batch (a GPU-size smoke run: about 50 rows at
        # batch 128): the run takes them all as its batch rather than no step at all
        n = int(self.train.sum())
        share = batching.split(self.cfg.global_batch, None, chips=self.rt.world, processes=self.rt.world).per_process
        self.batch = max(1, min(share, n // self.rt.world))
        self.per_epoch = data.EpochSampler(n, self.batch, world=self.rt.world).batches_per_epoch
        self.epochs = budget_epochs(self.cfg, self.per_epoch)
        self.total = self.epochs * self.per_epoch  # optimizer steps

    def start_features(self, enc: Encoder, mask: np.ndarray, tokens: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """The starting encoder's pooled vectors (and with `tokens` its pooled token grids, float32) of the
        masked rows' centre crops, no augmentation, the encoder in eval mode: what the probes read
        (features.extract)."""
        rows = [r for r, m in zip(self.rows, mask) if m]
        was_training = enc.training
        enc.eval()
        f = features.extract(enc, self.tcfg, rows, self.tcfg.data.cache, self.cfg.token_pool, self.rt.device,
                             self.cfg.eval_batch, precision="bf16" if self.rt.bf16 else "fp32", tokens=tokens,
                             token_dtype=torch.float32, pad=self.rt.kind == "xla")
        enc.train(was_training)
        return f["pooled"], f["tokens"]

    def scaled(self, head: nn.Module) -> probe_heads.ScaledHeads:
        """`head` behind ChannelScalers of the starting encoder's features over the train rows (what
        the probes' heads read; docs/recipe.md, Fine-tuning), fixed through the run and saved with
        the head (a resumed run loads the saved ones over these)."""
        tokens = probe_heads.reads_tokens(self.kind)
        pooled, grids = self.start_features(self.model.encoder, self.train, tokens)
        return probe_heads.ScaledHeads(head, probe_heads.ChannelScaler(pooled),
                                       probe_heads.ChannelScaler(grids) if tokens else None).to(self.rt.device)


    # ------------------------------------------------------------ state
    def settings(self) -> dict:
        """What the weights depend on: a resume under other settings is refused."""
        return {k: v for k, v in config.to_dict(self.cfg).items() if k not in RESUME_FREE}

    def position(self) -> int:
        """Where the run is, in the unit it is scored at: whole epochs, or with `val_every` optimizer
        steps (a checkpoint's number, and the best one's `best_epoch` or `best_step`)."""
        return self.step if self.cfg.val_every else self.epoch

    def state(self, best: bool = False) -> dict:
        st = {"config": config.to_dict(self.tcfg), "target": self.model.encoder.state_dict(),
              "head": self.model.head.state_dict(), "step": self.position(),
              "finetune": {"settings": self.settings(), "task": self.cfg.task, "head": self.kind,
                           "classes": self.spec["names"], "token_pool": list(self.cfg.token_pool),
                           "from": self.ident, "best": self.best}}
        if not best:
            st.update(optimizer=self.opt.state_dict(), train_step=self.step, batch_split=self.batch_split(), stale=self.stale,
                      history=self.history, **self.guard.state())
        return to_cpu(st)  # a copy: the background write (TrainLoop.save) runs while training goes on

    def _saved_state(self) -> tuple[str, dict] | None:
        """The newest good checkpoint of this run folder, if any, refused (naming the keys) when it
        was made under other settings."""
        found = self.newest_checkpoint()
        if found is None:
            return None
        uri, st = found
        saved = settings_with_global_batch(st["finetune"]["settings"], saved_split(st)["world"])
        changed = sorted(k for k in set(saved) | set(self.settings()) if saved.get(k) != self.settings().get(k))
        if changed:
            raise cli.UsageError(f"{uri}: this fine-tuning run was made with other settings ({', '.join(changed)}); "
                                 f"set out= to start a new run, or put them back to resume")
        return found

    def batch_split(self) -> dict:
        """What an optimizer step is here: `batch` rows on each of `world` processes."""
        return {"batch": self.batch, "world": self.rt.world}

    def _resume_step(self, uri: str, st: dict) -> int:
        """The checkpoint's place as this run's optimizer step: its epoch and the samples into it
        (data.data_position), converted to this run's batch and process count, as pretraining
        resumes. Refused (naming both splits) where no whole number of this run's steps reaches it,
        and with `val_every`, whose checkpoints, history and best are counted in the saved steps."""
        saved, n, old = int(st["train_step"]), int(self.train.sum()), saved_split(st)
        pos = data.data_position(saved, n, old["batch"], old["world"])
        start = data.start_batch_for(pos, n, self.batch, self.rt.world)
        if start != saved and (start is None or self.cfg.val_every):
            why = "whole steps of this batch split do not reach it" if start is None else \
                "val_every counts its checkpoints, history and best in the saved split's steps"
            raise cli.UsageError(
                f"{uri}: saved at epoch {pos['epoch']}, {pos['offset']} samples into it, with batch {old['batch']} x "
                f"{old['world']} process(es); this run has batch {self.batch} x {self.rt.world} process(es) and "
                f"{why}: resume on {old['world']} process(es), or set out= to start a new run")
        if (old["batch"], old["world"]) != (self.batch, self.rt.world) and self.rt.is_master:
            print(f"resume: batch {old['batch']} x {old['world']} process(es) -> {self.batch} x {self.rt.world}: "
                  f"epoch {pos['epoch']} continues at step {start} of {self.total}")
        return start

    def _resume(self, uri: str, st: dict) -> str:
        self.model.encoder.load_state_dict(st["target"])
        self.model.head.load_state_dict(st["head"])
        load_optimizer(self.opt, st["optimizer"], self.lrs)
        self.step = self._resume_step(uri, st)
        self.epoch = self.step // self.per_epoch
        self.ident = st["finetune"]["from"]  # the start it trained from, saved at its first save (ckpt may point on)
        self.best, self.history, self.stale = st["finetune"]["best"], list(st["history"]), int(st["stale"])
        self.guard.load_state(st)
        return uri

    def save_best(self) -> None:
        """best.pt, written before every process reads on (finish loads it on each)."""
        if self.rt.is_master:
            checkpoint.write(self.state(best=True), self.folder.finetuned())
        self.rt.barrier()

    # ------------------------------------------------------------ data and steps
    def loader(self, start_step: int):
        """(batches per epoch, the loader from optimizer step `start_step` to the budget's end)."""
        cfg, rows = self.cfg, [r for r, t in zip(self.rows, self.train) if t]
        y = [int(v) for v in self.y[self.train]]
        ds = data.CacheDataset(rows, self.tcfg.data, None, None, None, training_seed(cfg), augment=cfg.augment)
        sampler = data.EpochSampler(len(rows), self.batch, self.rt.rank, self.rt.world, training_seed(cfg), True,
                                    start_step, self.total)
        dl = data.batch_loader(Labelled(ds, y), self.batch, sampler, cfg.workers, self.tcfg.data.start_method,
                               pin=self.rt.kind == "cuda", prefetch_factor=self.tcfg.data.prefetch_factor)
        return sampler.batches_per_epoch, dl

    def frozen(self, epoch: int) -> bool:
        return epoch < self.cfg.frozen_epochs

    def set_phase(self, epoch: int) -> None:
        """Training modes for the epoch: the encoder frozen (no gradients, eval mode: AdamW leaves
        it bit for bit) or trained with the head."""
        frozen = self.frozen(epoch)
        self.model.train()
        self.model.encoder.requires_grad_(not frozen)
        if frozen:
            self.model.encoder.eval()

    def write_schedules(self, clock: torch.Tensor) -> None:
        """Each group's learning rate from the device clock (TrainLoop.advance_schedules): its peak x
        warmup and cosine, the encoder's groups ramped up again from the step it thaws (thaw_ramp)."""
        warmup = self.warmup_steps()
        self.factor = f = lr_factor(clock, self.total, warmup)  # kept for the log record
        f_enc = f * thaw_ramp(clock, self.cfg.frozen_epochs * self.per_epoch, warmup)
        for g, lr in zip(self.groups, self.lrs):
            lr.copy_(g["peak_lr"] * (f_enc if g["encoder"] else f))

    def update(self, net, b: dict) -> torch.Tensor:
        x = data.normalize(b["x"], b["aug"])
        with self.rt.autocast():
            logits = net(x)
        loss = F.cross_entropy(logits.float(), b["y"], weight=self.weight, label_smoothing=self.cfg.label_smoothing)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)  # frozen ones have no grad
        ok = self.guard.accepts(loss.detach(), gnorm)
        guarded_step(self.opt, ok)  # a non-finite loss (a bf16 overflow, a bad batch) leaves everything as it was
        self.guard.record(ok, loss.detach())
        return loss.detach()

    @torch.no_grad()
    def predict(self, mask: np.ndarray) -> np.ndarray:
        """Class probabilities [n, C] of the masked rows: centre crop, no augmentation (as the probes see
        them), through the probes' features loop (features.extract_all) and the head. Leaves the model in
        eval mode (the loop calls set_phase after a score)."""
        self.model.eval()
        batches = self.inputs(mask)
        if not batches:
            return np.zeros((0, self.spec["classes"]))
        reads = probe_heads.reads_tokens(self.kind)
        f = features.extract_all({"": self.model.encoder}, self.tcfg, [], self.tcfg.data.cache, self.cfg.token_pool,
                                 self.rt.device, precision="bf16" if self.rt.bf16 else "fp32", tokens=reads,
                                 token_dtype=torch.float32, batches=batches)[""]
        pooled = torch.from_numpy(f["pooled"]).to(self.rt.device)
        grids = torch.from_numpy(f["tokens"]).to(self.rt.device) if reads else None
        logits = self.model.head(pooled, grids)[:, 0]
        return torch.softmax(logits.float(), -1).cpu().numpy()

    def inputs(self, mask: np.ndarray) -> list:
        """The masked rows' cropped uint8 batches, read from the cache once and kept (validation
        scores the same rows every epoch; a val split of 1,000 volumes at 32 x 96 x 96 is 0.3 GB)."""
        key = np.packbits(mask).tobytes()
        if key not in self._inputs:
            rows = [r for r, m in zip(self.rows, mask) if m]
            d = self.tcfg.data
            self._inputs[key] = list(encoder.volume_batches(d.cache, rows, d.stride, d.input_shape, self.cfg.eval_batch,
                                                            pad=self.rt.kind == "xla"))
        return self._inputs[key]

    def validate(self) -> dict:
        va = self.split == "val"
        prob = self.predict(va)
        k = self.spec["classes"]
        return {"epoch": epochs_of(self.step, self.per_epoch), "step": self.step,
                "balanced_accuracy": pm.balanced_accuracy(self.y[va], prob.argmax(1), k),
                "auroc": pm.macro_auroc(self.y[va], prob)}

    # ------------------------------------------------------------ the loop
    def run(self, progress: bool = True) -> dict:
        if self.rt.is_master:
            self.folder.root.mkdir(parents=True, exist_ok=True)
            fsio.atomic_write_bytes(str(self.folder.finetune), json.dumps(config.to_dict(self.cfg), indent=1).encode())
        super().run(progress)
        return self.finish()

    def spends_patience(self, epoch: float) -> bool:
        """Whether a val score at `epoch` (epochs trained, a fraction with `val_every`) without a
        better one counts toward `patience`: not in the frozen epochs nor in the encoder's warmup
        after them, where it cannot improve yet, and not in the first half of the run's epochs,
        where a random-init encoder at 10% of labels was still at chance (docs/recipe.md, Fine-tuning)."""
        warmup = math.ceil(self.cfg.warmup_epochs)
        return epoch > max(self.cfg.frozen_epochs + warmup, math.ceil(self.total / self.per_epoch / 2))

    def warmup_steps(self) -> int:
        return round(self.cfg.warmup_epochs * self.per_epoch)

    def stopped(self) -> bool:
        return bool(self.cfg.patience) and self.stale >= self.cfg.patience

    def scored_now(self) -> bool:
        """A val score after this step: at each epoch's end, or every `val_every` steps; and at the
        budget's end whatever the unit."""
        every = self.cfg.val_every or self.per_epoch
        return self.step % every == 0 or self.step == self.total

    def _loop(self, log: metrics.MetricsLog, bar) -> None:
        cfg, rt = self.cfg, self.rt
        if self.step >= self.total or self.stopped():
            return
        it = iter(rt.loader(self.loader(self.step)[1]))
        self.start_clock()
        net, phase, losses = None, None, []
        self.set_phase(self.epoch)
        while self.step < self.total and not self.stopped():
            if self.frozen(self.epoch) != phase:  # wrap once per phase: DDP takes the parameters that train
                net = None
                self.set_phase(self.epoch)
                net, phase = rt.wrap(self.model), self.frozen(self.epoch)
            torch.manual_seed(training_seed(cfg) * 1000003 + self.step)  # stochastic depth: the same on a resume
            self.advance_schedules()
            losses.append(self.update(net, rt.to_device(next(it))))
            rt.sync()
            self.step += 1
            self.epoch = self.step // self.per_epoch
            bar.update(1)
            self.writer.poll()  # a finished write's error stops the run
            if self.step % cfg.log_every == 0:
                self.log_step(log, {"epoch": self.epoch, "loss": float(losses[-1]), "lr_factor": float(self.factor)})
            if self.scored_now():
                self.score(log, losses, bar)
                losses = []
                self.set_phase(self.epoch)  # predict() left the model in eval mode

    def score(self, log: metrics.MetricsLog, losses: list, bar) -> None:
        """Score on val, keep the best state, spend patience, save the run."""
        v = self.validate()
        v["loss"] = float(torch.stack(losses).mean())
        if self.rt.kind == "xla":
            v.update(xla_compiles())  # per score: a graph that changes with the epoch would show here
        self.history.append(v)
        log.log(v, prefix="val")
        if self.best is None or probe.val_rank(v["balanced_accuracy"], v["auroc"]) > \
                probe.val_rank(self.best["balanced_accuracy"], self.best["auroc"]):
            self.best, self.stale = v, 0
            self.save_best()
        elif self.spends_patience(v["epoch"]):
            self.stale += 1
        bar.set_postfix(loss=f"{v['loss']:.3f}", val_bal_acc=f"{v['balanced_accuracy']:.3f}",
                        best_epoch=self.best["epoch"], refresh=False)
        self.save()

    # ------------------------------------------------------------ results
    def finish(self) -> dict:
        """The best epoch's weights scored on val and test, reported as `make probe` reports."""
        best = checkpoint.load(self.folder.finetuned())
        self.model.encoder.load_state_dict(best["target"])
        self.model.head.load_state_dict(best["head"])
        k, names = self.spec["classes"], self.spec["names"]
        groups = np.array([r["participant_id"] for r in self.rows])
        scanners = np.array([r["device"] for r in self.rows])
        evaluated = (self.split == "val") | (self.split == "test")
        prob = np.zeros((len(self.rows), k))
        prob[evaluated] = self.predict(evaluated)
        test = self.split == "test"
        name = f"finetuned_{self.cfg.init}"
        res = {"encoder": name, "head": self.kind, "lr": self.cfg.lr, "weight_decay": self.cfg.weight_decay,
               "val_balanced_accuracy": best["finetune"]["best"]["balanced_accuracy"],
               "val_auroc": best["finetune"]["best"]["auroc"], "best_epoch": best["finetune"]["best"]["epoch"],
               "best_step": best["finetune"]["best"]["step"],
               "val": probe.evaluate(prob, self.y, groups, self.split == "val", k, self.cfg),
               "test": probe.evaluate(prob, self.y, groups, test, k, self.cfg)}
        result = {"task": self.cfg.task, "classes": names, "probes": [res], "cross_scanner": None,
                  "counts": {s: np.bincount(self.y[(self.split == s) & (self.train | (s != "train"))],
                                            minlength=k).tolist() for s in ("train", "val", "test")},
                  "per_scanner": {self.kind: {d: probe.evaluate(prob, self.y, groups, test & (scanners == d), k, self.cfg)
                                                 for d in sorted(set(scanners[test]))}},
                  "plotted_head": self.kind, "from": self.ident, "epochs_run": epochs_of(self.step, self.per_epoch),
                  "history": self.history, "label_fraction": self.cfg.label_fraction,
                  "train_participants": int(len(set(groups[self.train]))), "best_checkpoint": self.folder.finetuned()}
        if self.rt.is_master:
            out = self.folder.root / self.cfg.task
            probe.write_report(result, out, self.y[test], prob[test])
            plot_history(self.history, out / "curves.png", f"{self.cfg.task}: fine-tuning ({self.cfg.init})")
        return {**result, "prob": prob}  # every row's class probabilities (val and test filled): in memory only


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make finetune", description=__doc__)
    ap.add_argument("--config", default=None)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    cfg = config.load(FinetuneConfig, a.config, a.overrides)
    if a.ckpt:
        cfg.ckpt = a.ckpt
    rt = runtime.setup(cfg.device, cfg.precision)
    t0 = time.perf_counter()
    ft = Finetuner(cfg, rt)
    if rt.is_master:
        where = f"resumed from {ft.resumed} at epoch {ft.epoch}" if ft.resumed else "from the start"
        print(f"finetune: {cfg.task} from {cfg.ckpt} ({cfg.init} init), head {ft.kind}, {int(ft.train.sum())} train "
              f"volumes ({100 * cfg.label_fraction:g}% of the train participants), on {rt.kind} x{rt.world}, {where}")
    res = ft.run(progress=not a.no_progress)
    rt.shutdown()
    if rt.is_master:
        t = res["probes"][0]["test"]
        rows = [(d, m["n"], cli.fmt_number(m["balanced_accuracy"], m.get("balanced_accuracy_ci95")),
                 cli.fmt_number(m["auroc_macro_ovr"])) for d, m in res["per_scanner"][ft.kind].items()]
        rows.append(("all", t["n"], cli.fmt_number(t["balanced_accuracy"], t["balanced_accuracy_ci95"]),
                     cli.fmt_number(t["auroc_macro_ovr"], t["auroc_macro_ovr_ci95"])))
        print(f"\n{cfg.task} (test, best val epoch {res['probes'][0]['best_epoch']} of {res['epochs_run']}):")
        print(cli.format_table(["device", "n", "balanced acc [95% CI]", "AUROC"], rows))
        print(f"\nfinetune: report in {ft.folder.root / cfg.task}/ (metrics.json, report.md, confusion.png, roc.png, "
              f"curves.png); best model {res['best_checkpoint']} (make export CKPT=... OUT=...); "
              f"{time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    cli.run(main)
