"""Training volumes held in accelerator memory, cropped and resized there (`data.resident`).

A small cache (the learning check's: 2,250 volumes of 32 x 128 x 128 uint8, 1.2 GB) fits many
times over in a GPU's memory, and there the loader, not the chip, sets the pace: the random-resized
crop costs tens of milliseconds of a core per sample (docs/accelerators.md). With the volumes
resident, the loader's processes draw only what is random per sample (the box, the flip, the
intensity jitter and the masks, `data.CacheDataset(volumes=False)`) and the step cuts and resizes
the boxes on the device: the same crop, box by box, as the production transforms (a box of a
fraction of `input_shape` at a random place, resized back trilinearly, then the left-right flip).
Caches that do not fit keep the production loader.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from cache import store

FREE_SHARE = 0.2  # `auto`: the volumes may take this share of the device's free memory


def strided_bytes(rows: list[dict], stride) -> int:
    return sum(int(np.prod([-(-int(n) // int(s)) for n, s in zip(r["shape"], stride)])) for r in rows)


def wanted(mode: str, device: torch.device, rows: list[dict], stride) -> bool:
    """`data.resident`: "always" on any device, "never" never, "auto" on CUDA when the strided volumes
    take at most FREE_SHARE of the free device memory."""
    if mode == "always":
        return True
    if mode == "never" or device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return strided_bytes(rows, stride) <= FREE_SHARE * free


class ResidentVolumes:
    """Every row's strided volume in one uint8 tensor [n, D, H, W] on `device` (rows of one shape)."""

    def __init__(self, cache: str, rows: list[dict], stride, device: torch.device, progress: bool = False):
        first = self._read(cache, rows[0], stride)
        self.volumes = torch.empty((len(rows), *first.shape), dtype=torch.uint8, device=device)
        for i, r in enumerate(tqdm(rows, desc="volumes to the device", unit="vol", disable=not progress,
                                   dynamic_ncols=True)):
            v = first if i == 0 else self._read(cache, r, stride)
            if v.shape != first.shape:
                raise ValueError(f"{r['relpath']}: cached shape {list(v.shape)} differs from {list(first.shape)} "
                                 "(data.resident needs one shape; set data.resident=never)")
            self.volumes[i].copy_(torch.from_numpy(v))

    @staticmethod
    def _read(cache: str, row: dict, stride) -> np.ndarray:
        return np.ascontiguousarray(store.read_volume(cache, row["volume"])[::stride[0], ::stride[1], ::stride[2]])

    def crops(self, index: torch.Tensor, box: torch.Tensor, flip: torch.Tensor, shape) -> torch.Tensor:
        """uint8 [B, 1, *shape]: per sample the box (start d, h, w, size d, h, w) of its volume,
        resized to `shape` (trilinear, as the production transforms; a box of `shape` itself is
        copied as it is) and flipped left-right where `flip`. The box, flip and index come from
        the loader (host values: one small copy per batch)."""
        index, box, flip = index.tolist(), box.tolist(), flip.tolist()
        out = torch.empty((len(index), 1, *shape), dtype=torch.uint8, device=self.volumes.device)
        for j, (i, b, f) in enumerate(zip(index, box, flip)):
            v = self.volumes[i, b[0]:b[0] + b[3], b[1]:b[1] + b[4], b[2]:b[2] + b[5]]
            if tuple(b[3:]) != tuple(shape):
                v = F.interpolate(v[None, None].float(), size=tuple(shape), mode="trilinear",
                                  align_corners=False)[0, 0].round_().clamp_(0, 255).to(torch.uint8)
            out[j, 0] = v.flip(-1) if f else v
        return out


def draw_box(rng: np.random.Generator, full, shape, scale, zoom: bool) -> np.ndarray:
    """(start d, h, w, size d, h, w): a box of `shape` (or, with `zoom`, of a size drawn per axis
    between scale[0] and scale[1] of it) at a uniformly random place inside `full`."""
    if zoom:
        size = [int(rng.integers(max(1, round(scale[0] * n)), max(1, round(scale[1] * n)) + 1)) for n in shape]
    else:
        size = [int(n) for n in shape]
    start = [int(rng.integers(0, f - s + 1)) for f, s in zip(full, size)]
    return np.array(start + size, dtype=np.int32)
