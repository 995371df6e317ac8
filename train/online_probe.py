"""The online probe: while pretraining runs, how well do the EMA target encoder's pooled
features separate the probe tasks? Every `eval_every` steps (and once at step 0, the
random-init floor) it encodes a fixed subset of labelled train and val rows and scores val
with a class-balanced cosine k-NN and a closed-form ridge classifier, per task. Cheap
enough to run often; `make probe` stays the measurement that counts."""
from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch

from manifests.aireadi import TASKS
from octfm.scores import balanced_accuracy
from train import data, encoder
from train.config import TrainConfig
from train.model import Encoder


def evenly_spaced(rows: list[dict], cap: int) -> list[dict]:
    """At most `cap` rows spread evenly over the list (sorted by path): fixed across steps and runs."""
    if len(rows) <= cap:
        return rows
    return [rows[i] for i in np.linspace(0, len(rows) - 1, cap).round().astype(int)]


def probe_rows(cfg: TrainConfig) -> dict[str, list[dict]]:
    """The labelled train and val rows the online probe encodes (capped by online_probe.max_*)."""
    caps = {"train": cfg.online_probe.max_train, "val": cfg.online_probe.max_val}
    return {split: evenly_spaced(data.select_rows(cfg.data.cache, [split], cfg.data.scanners, labelled=True), cap)
            for split, cap in caps.items()}


def knn_predict(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, k: int, classes: int) -> np.ndarray:
    """Cosine k-NN on features standardised per channel by the train rows (as ridge and the
    offline probes see them: a few large channels of max-pooled features, not the cue, would
    otherwise decide every neighbour); each neighbour's vote is weighted by 1 / its class's
    train count, so the majority class does not win by numbers alone."""
    mu, sd = train_x.mean(0), train_x.std(0) + 1e-6
    a, b = (train_x - mu) / sd, (test_x - mu) / sd
    a /= np.linalg.norm(a, axis=1, keepdims=True) + 1e-8
    b /= np.linalg.norm(b, axis=1, keepdims=True) + 1e-8
    k = min(k, len(a))
    nearest = np.argsort(-(b @ a.T), axis=1, kind="stable")[:, :k]
    weight = 1.0 / np.maximum(np.bincount(train_y, minlength=classes), 1)
    votes = np.zeros((len(b), classes))
    np.add.at(votes, (np.repeat(np.arange(len(b)), k), train_y[nearest].ravel()), weight[train_y[nearest]].ravel())
    return votes.argmax(1)


def ridge_predict(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, penalty: float,
                  classes: int) -> np.ndarray:
    """Closed-form ridge regression onto one-hot labels (standardised features, class-balanced
    sample weights, penalty scaled by the feature count); the largest output is the class."""
    mu, sd = train_x.mean(0), train_x.std(0) + 1e-6
    a, b = (train_x - mu) / sd, (test_x - mu) / sd
    w = (1.0 / np.maximum(np.bincount(train_y, minlength=classes), 1))[train_y]
    w *= len(w) / w.sum()
    y = np.eye(classes)[train_y] - 1.0 / classes
    aw = a * w[:, None]
    coef = np.linalg.solve(aw.T @ a + penalty * len(a) * np.eye(a.shape[1]), aw.T @ y)
    return (b @ coef).argmax(1)


def scores(train_x, train_labels, val_x, val_labels, k: int, penalty: float) -> dict:
    """{<task>/knn_bal_acc, <task>/ridge_bal_acc} on val for every probe task; None when the
    task's train rows hold a single class."""
    out = {}
    for task, spec in TASKS.items():
        c = spec["classes"]
        ytr = np.array([spec["map"](v) for v in train_labels])
        yva = np.array([spec["map"](v) for v in val_labels])
        usable = len(np.unique(ytr)) > 1 and len(yva) > 0
        out[f"{task}/knn_bal_acc"] = balanced_accuracy(yva, knn_predict(train_x, ytr, val_x, k, c), c) \
            if usable else None
        if penalty > 0:
            out[f"{task}/ridge_bal_acc"] = balanced_accuracy(
                yva, ridge_predict(train_x.astype(np.float64), ytr, val_x.astype(np.float64), penalty, c), c) \
                if usable else None
    return out


class OnlineProbe:
    """Built once per run (rows chosen, nothing read yet); `__call__` scores an encoder. The
    cropped uint8 inputs stay in memory after the first call when they fit in
    online_probe.memory_mb (reading is most of the cost at small model sizes)."""

    def __init__(self, cfg: TrainConfig, device: torch.device, autocast=contextlib.nullcontext):
        self.cfg, self.device, self.autocast = cfg, device, autocast
        self.rows = probe_rows(cfg)
        n = len(self.rows["train"]) + len(self.rows["val"])
        self.keep = n * math.prod(cfg.data.input_shape) <= cfg.online_probe.memory_mb * 2 ** 20
        self._inputs: dict[str, list] = {}

    @property
    def usable(self) -> bool:
        return bool(self.rows["train"]) and bool(self.rows["val"])

    def inputs(self, split: str):
        """The split's uint8 batches (padded to one shape), from memory when kept."""
        if split in self._inputs:
            return self._inputs[split]
        c = self.cfg
        batches = encoder.volume_batches(c.data.cache, self.rows[split], c.data.stride, c.data.input_shape,
                                        c.online_probe.batch_size, pad=True)
        if self.keep:
            batches = self._inputs[split] = list(batches)
        return batches

    @torch.no_grad()
    def features(self, enc: Encoder, split: str) -> np.ndarray:
        """Pooled features [n, d]; every batch has the same shape (one compiled graph on XLA)."""
        out = []
        for x, n in self.inputs(split):
            with self.autocast():
                h = encoder.tokens(enc, x.to(self.device))
            out.append(enc.pool(h).cpu()[:n])
        return torch.cat(out).numpy()

    def __call__(self, enc: Encoder, step: int) -> dict:
        """The probe record for metrics.jsonl: step, scores per task, rows used and seconds."""
        t0 = time.perf_counter()
        tr, va = self.rows["train"], self.rows["val"]
        ftr, fva = self.features(enc, "train"), self.features(enc, "val")
        p = self.cfg.online_probe
        rec = {"step": step, **scores(ftr, [r["label"] for r in tr], fva, [r["label"] for r in va], p.k, p.ridge)}
        rec.update({"train_rows": len(tr), "val_rows": len(va), "seconds": round(time.perf_counter() - t0, 3)})
        return rec
