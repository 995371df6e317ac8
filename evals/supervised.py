"""A supervised reference for the learning check: the pretraining config's encoder trained end
to end on one task's labels (train split only, the same random crops and flips), saved as a
checkpoint that the probes read exactly like a pretrained one.

Its frozen features under the same heads, splits and bootstrap say what label-aware features of
this architecture reach on a cohort at this size: the ceiling a self-supervised encoder can hope
to approach, and whether the check can see a gain at all. It is a measurement of the check, not
a competitor: it sees the labels that pretraining never does.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from evals import probe_heads
from manifests.aireadi import TASKS
from octfm import cli, config
from train import checkpoint, data, masks, runtime
from train.config import TrainConfig
from train.model import Encoder
from train.pretrain import to_cpu


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
          progress: bool = True, dataset=Labelled, participants: set[str] | None = None) -> str:
    """Train encoder + linear head on `task` for `steps` steps on the config's device and
    precision (the GPU size: cuda in bf16); returns the checkpoint
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
    # a 10% warmup; at exactly 10 steps that is one step, where OneCycleLR divides by zero
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.2 if steps == 10 else 0.1)
    weight = probe_heads.class_weights(y, spec["classes"]).to(rt.device)
    grid = masks.grid_for(cfg.data.input_shape, cfg.model.tubelet)
    ds = data.CacheDataset(rows, cfg.data, cfg.mask, grid, masks.calibrate(grid, cfg.mask, seed=cfg.seed), cfg.seed)
    batch = min(cfg.batch_size, len(rows))  # a small cohort's label fraction can hold fewer rows than a batch
    sampler = data.EpochSampler(len(rows), batch, seed=cfg.seed, stop_batch=steps)
    workers = data.loader_workers(cfg.data.workers)
    kw = {"num_workers": workers, "persistent_workers": True, "multiprocessing_context": cfg.data.start_method} \
        if workers > 0 else {}
    dl = DataLoader(dataset(ds, y), batch_size=batch, sampler=sampler, drop_last=True,
                    pin_memory=rt.kind == "cuda", **kw)
    bar = tqdm(total=steps, desc=f"supervised {task}", unit="step", disable=not progress, dynamic_ncols=True)
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
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    state = {"config": config.to_dict(cfg), "target": to_cpu(enc.state_dict()), "head": to_cpu(head.state_dict()),
             "step": steps,
             "supervised": {"task": task, "lr": lr, "weight_decay": weight_decay}}
    return checkpoint.save(state, ckpt_dir, steps)
