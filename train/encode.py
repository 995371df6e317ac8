"""A frozen encoder over cached volumes: centre crop, no augmentation (the one pooling of
token features into a vector is `Encoder.pool`). Shared by the online probe during
pretraining and the probes' offline feature extraction, so both score the same features."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from cache import store
from train import data
from train.model import Encoder


def center_crop(vol, shape):
    """The central `shape` of the last len(shape) axes (numpy arrays and tensors, batched or not)."""
    lead = vol.ndim - len(shape)
    starts = [(n - s) // 2 for n, s in zip(vol.shape[lead:], shape)]
    return vol[(Ellipsis, *(slice(a, a + s) for a, s in zip(starts, shape)))]


def volume_batches(cache: str, rows: list[dict], stride, shape, batch: int, pad: bool = False
                   ) -> Iterator[tuple[torch.Tensor, int]]:
    """uint8 batches [b, 1, D, H, W] of the rows' volumes (strided, centre-cropped) with the
    count of real rows in each; `pad` fills the last batch with zeros to `batch` rows, so a
    compiled graph sees one shape."""
    for i in range(0, len(rows), batch):
        vols = [torch.from_numpy(np.ascontiguousarray(
            center_crop(store.read_volume(cache, r["volume"])[::stride[0], ::stride[1], ::stride[2]], shape)))[None]
            for r in rows[i:i + batch]]
        n = len(vols)
        if pad and n < batch:
            vols += [torch.zeros_like(vols[0])] * (batch - n)
        yield torch.stack(vols), n


def tokens(enc: Encoder, x_u8: torch.Tensor) -> torch.Tensor:
    """Token features [b, N, d] (float32) of uint8 volumes, normalised without jitter."""
    aug = torch.tensor([[1.0, 0.0]], device=x_u8.device).expand(x_u8.shape[0], 2)
    return enc(data.normalize(x_u8, aug)).float()

