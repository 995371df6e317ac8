"""The model `make finetune` trains (evals/finetune.py): the encoder with one of the probes' heads, and its
AdamW groups with a learning rate per layer (layer-wise decay)."""
from __future__ import annotations

import torch
import torch.nn as nn

from evals import probe_heads
from evals.config import FinetuneConfig
from train.model import Encoder
from train.optim import decays


class Classifier(nn.Module):
    """Encoder + one probe head (evals/probe_heads.py) over its pooled vector or pooled token grid."""

    def __init__(self, enc: Encoder, head: str, classes: int, token_pool):
        super().__init__()
        self.encoder, self.kind, self.token_pool = enc, head, tuple(token_pool)
        dim = enc.norm.normalized_shape[0]
        self.head = probe_heads.make_heads(head, 1, dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        tokens = self.encoder.pool_grid(h, self.token_pool) if probe_heads.reads_tokens(self.kind) else None
        return self.head(self.encoder.pool(h), tokens)[:, 0]            # [B, classes]


def layer_id(name: str, depth: int) -> int:
    """0 for the stem and patchify, i + 1 for block i, and the final norm with the last block
    (depth) (encoder names)."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth if name.startswith("norm.") else 0


def layer_groups(model: Classifier, cfg: FinetuneConfig) -> list[dict]:
    """AdamW groups, each with its peak lr: encoder layer l at lr x layer_decay^(depth - l) (the
    last block and the final norm at lr, the patchify lowest), the head at head_lr; weight decay
    on weights only (`decays`: not on biases, the head's included, nor norms)."""
    depth = len(model.encoder.blocks)
    groups: dict[tuple, dict] = {}
    for name, p in model.named_parameters():
        if name.startswith("encoder."):
            sub = name[len("encoder."):]
            lr = cfg.lr * cfg.layer_decay ** (depth - layer_id(sub, depth))
            key = (f"layer_{layer_id(sub, depth)}", decays(sub, p))
        else:
            lr, key = cfg.head_lr, ("head", decays(name, p))
        g = groups.setdefault(key, {"params": [], "names": [], "peak_lr": lr, "encoder": key[0] != "head",
                                    "weight_decay": cfg.weight_decay if key[1] else 0.0})
        g["params"].append(p)
        g["names"].append(name)
    return list(groups.values())
