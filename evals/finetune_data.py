"""What `make finetune` (evals/finetune.py) trains on: the labelled rows with the train mask of a label
fraction, and the training dataset's augmented crops with their classes."""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from evals import probe, subsets
from evals.config import FinetuneConfig
from octfm import cli
from train import data


def training_rows(cfg: FinetuneConfig, cache: str) -> tuple[list[dict], np.ndarray]:
    """The labelled rows (leak-checked: fine-tuning tests on participants it never trained on)
    and the train mask: the train split, or its stratified label fraction of participants."""
    rows = probe.labelled_rows(cache, cfg.seed, shuffle=False)
    if not rows:
        raise cli.UsageError(f"cache: no labelled ok volumes in {cache}")
    people = subsets.nested_fractions(rows, [cfg.label_fraction], cfg.seed)[cfg.label_fraction]
    return rows, subsets.train_mask(rows, people)


class Labelled(Dataset):
    """The training dataset's crop and flip of a row (data.CacheDataset, no masks), with its class."""

    def __init__(self, ds: data.CacheDataset, y: list[int]):
        self.ds, self.y = ds, y

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key) -> dict:
        item = self.ds[key]
        return {"x": item["x"], "aug": item["aug"], "y": torch.tensor(self.y[key[1]])}  # a tensor: XLA's loader shards it
