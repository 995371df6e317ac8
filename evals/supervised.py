"""A supervised reference for the learning check: the pretraining config's encoder trained end
to end on one task's labels (train split only, the same random crops and flips), saved as a
checkpoint that the probes read exactly like a pretrained one.

Its frozen features under the same heads, splits and bootstrap say what label-aware features of
this architecture reach on a cohort at this size: the ceiling a self-supervised encoder can hope
to approach, and whether the check can see a gain at all. It is a measurement of the check, not
a competitor: it sees the labels that pretraining never does.
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from evals import probe_heads
from manifests.aireadi import TASKS
from octfm import cli, config, procs
from octfm.scores import balanced_accuracy
from train import checkpoint, data, encoder, masks, runtime
from train.config import TrainConfig
from train.model import Encoder
from train.step import to_cpu

WARMUP = 0.1  # the one-cycle schedule's warmup share (0.2 at exactly 10 steps, where 0.1 divides by zero)


@dataclasses.dataclass(frozen=True)
class Stopping:
    """Early stopping on val (docs/learning-check.md, decision 17): the reference's own head scored
    on the val centre crops every `every` steps and at the last; the best state is kept, and after
    `patience` scores in a row without a better one past the warmup the training stops. `every` 0:
    no scores, all `steps` are trained and the last state is kept (the CPU size)."""
    every: int = 0
    patience: int = 0

    @property
    def tag(self) -> str:
        """A run-name suffix: a reference trained under another rule is another reference."""
        return f"_stop{self.every}x{self.patience}" if self.every else ""


class ValScore:
    """The reference's own head on the labelled val rows' centre crops (read once and kept)."""

    def __init__(self, cfg: TrainConfig, task: str, batch: int):
        self.classes = TASKS[task]["classes"]
        rows = task_rows(cfg, "val")
        self.y = np.array([TASKS[task]["map"](r["label"]) for r in rows])
        d = cfg.data
        self.batches = list(encoder.volume_batches(d.cache, rows, d.stride, d.input_shape, batch))

    def __call__(self, enc: Encoder, head: nn.Module, rt: runtime.Runtime) -> float:
        return balanced_accuracy(self.y, own_head_predictions(enc, head, self.batches, rt), self.classes)


@torch.no_grad()
def own_head_predictions(enc: Encoder, head: nn.Module, batches, rt: runtime.Runtime | None = None,
                         change=None) -> np.ndarray:
    """The reference's own head's classes for `batches` (encoder.volume_batches: uint8 crops and
    the count of real rows), on `rt`'s device and precision (None: where the modules are, fp32);
    `change(x, start)` edits each batch first, `start` its first row's index (the cohort screen
    plants its cue with it). The encoder is scored in eval mode and left as it was."""
    was_training, pred, start = enc.training, [], 0
    enc.eval()
    for x, n in batches:
        x = x if change is None else change(x, start)
        x = x if rt is None else x.to(rt.device)
        with contextlib.nullcontext() if rt is None else rt.autocast():
            logits = head(enc.pool(enc(data.normalize(x))))
        pred.append(logits.float().argmax(1)[:n].cpu().numpy())
        start += n
    enc.train(was_training)
    return np.concatenate(pred)


def task_rows(cfg: TrainConfig, split: str = "train") -> list[dict]:
    """The split's labelled rows of the training config's cache and devices."""
    rows = data.select_rows(cfg.data.cache, [split], cfg.data.devices, labelled=True)
    if not rows:
        raise cli.UsageError(f"data.cache: {cfg.data.cache} has no labelled {split} rows for the supervised reference")
    return rows


class Labelled(Dataset):
    """The training dataset's crop and flip of a row, with its class (masks dropped)."""

    def __init__(self, ds: data.CacheDataset, y: list[int]):
        self.ds, self.y = ds, y

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key) -> dict:
        item = self.ds[key]
        return {"x": item["x"], "aug": item["aug"], "y": torch.tensor(self.y[key[1]])}  # a tensor: XLA's loader shards it


def train(cfg: TrainConfig, task: str, ckpt_dir: str, steps: int, lr: float = 3e-4, weight_decay: float = 0.05,
          progress: bool = True, dataset=Labelled, participants: set[str] | None = None,
          stop: Stopping = Stopping()) -> str:
    """Train encoder + linear head on `task` for `steps` steps (or fewer, `stop`) on the config's
    device and precision (the GPU size: cuda in bf16); returns the checkpoint
    (its `target` holds the encoder, so `evals.features.checkpoint_encoder` reads it). A finished
    checkpoint is reused: the check is resumable at this granularity. `dataset(ds, y)` wraps
    the crops (evals/cohort_screen.py plants a cue with it); `participants` narrows the train
    rows to a label fraction (the learning check's curves)."""
    done = checkpoint.newest_whole(ckpt_dir, warn=lambda _: None)
    if done:
        return done
    spec = TASKS[task]
    rows = [r for r in task_rows(cfg) if participants is None or r["participant_id"] in participants]
    y = [spec["map"](r["label"]) for r in rows]
    rt = runtime.setup(cfg.device, cfg.precision)
    torch.manual_seed(cfg.seed)
    enc = Encoder(cfg.model, cfg.data.input_shape).to(rt.device)
    head = nn.Linear(cfg.model.dim, spec["classes"]).to(rt.device)
    params = list(enc.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = 0.2 if steps == 10 else WARMUP
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=warmup)
    weight = probe_heads.class_weights(y, spec["classes"]).to(rt.device)
    grid = masks.grid_for(cfg.data.input_shape, cfg.model.tubelet)
    ds = data.CacheDataset(rows, cfg.data, cfg.mask, grid, masks.calibrate(grid, cfg.mask, seed=cfg.seed), cfg.seed)
    batch = min(cfg.batch_size, len(rows))  # a small cohort's label fraction can hold fewer rows than a batch
    sampler = data.EpochSampler(len(rows), batch, seed=cfg.seed, stop_batch=steps)
    workers = data.loader_workers(cfg.data.workers)
    kw = {"num_workers": workers, "persistent_workers": True, "multiprocessing_context": procs.worker_context(cfg.data.start_method)} \
        if workers > 0 else {}
    dl = DataLoader(dataset(ds, y), batch_size=batch, sampler=sampler, drop_last=True,
                    pin_memory=rt.kind == "cuda", **kw)
    bar = tqdm(total=steps, desc=f"supervised {task}", unit="step", disable=not progress, dynamic_ncols=True)
    val = ValScore(cfg, task, batch) if stop.every else None
    best = {"score": -1.0, "step": steps, "state": None, "stale": 0, "history": []}
    step = 0
    enc.train()
    for step, b in enumerate(rt.loader(dl), 1):  # CUDA: copied ahead on a side stream; XLA: placed by its loader
        b = rt.to_device(b)
        with rt.autocast():
            logits = head(enc.pool(enc(data.normalize(b["x"], b["aug"]))))
        loss = F.cross_entropy(logits.float(), b["y"], weight=weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        rt.sync()  # XLA: the step's graph
        bar.update(1)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", **({"val": f"{best['score']:.3f}"} if val else {}))
        if val and (step % stop.every == 0 or step == steps) and scored_stop(best, step, val(enc, head, rt), enc, head,
                                                                              stop, past_warmup=step > warmup * steps):
            break
    bar.close()
    meta = {"task": task, "lr": lr, "weight_decay": weight_decay}
    if val:
        meta.update(val_every=stop.every, patience=stop.patience, best_step=best["step"], stopped_at=step,
                    best_val_balanced_accuracy=best["score"], val_history=best["history"])
    enc_state, head_state = best["state"] or (to_cpu(enc.state_dict()), to_cpu(head.state_dict()))  # none kept: the last
    state = {"config": config.to_dict(cfg), "target": enc_state, "head": head_state, "step": best["step"],
             "supervised": meta}
    return checkpoint.save(state, ckpt_dir, best["step"])


def scored_stop(best: dict, step: int, score: float, enc: Encoder, head: nn.Module, stop: Stopping,
                past_warmup: bool) -> bool:
    """Record a val score; keep the state if it is the best so far (ties keep the earlier one).
    True when `stop.patience` scores in a row past the warmup have not beaten the best."""
    best["history"].append([step, round(score, 4)])
    if score > best["score"]:
        best.update(score=score, step=step, state=(to_cpu(enc.state_dict()), to_cpu(head.state_dict())), stale=0)
    elif past_warmup:
        best["stale"] += 1
    return bool(stop.patience) and best["stale"] >= stop.patience
