"""Training volumes held in accelerator memory, cropped and resized there (`data.resident`).

A small cache (the learning check's: 2,250 volumes of 32 x 128 x 128 uint8, 1.2 GB) fits many
times over in a GPU's memory, and there the loader, not the chip, sets the pace: the random-resized
crop costs tens of milliseconds of a core per sample (docs/accelerators.md). With the volumes
resident, the loader's processes draw only what is random per sample (the box, the flip, the
intensity jitter and the masks: `data.CacheDataset(volumes=False)`, `data.draw_box`) and the step
cuts and resizes every box of the batch on the device in one sampling op: the production
transform's crop, box by box (a box of a fraction of `input_shape` at a random place, resized back
trilinearly as F.interpolate does, then the left-right flip). Caches that do not fit keep the
production loader.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

from octfm.cli import UsageError
from train import data

FREE_SHARE = 0.2  # `auto`: the volumes may take this share of the device's free memory


def strided_bytes(rows: list[dict], stride) -> int:
    return sum(math.prod(data.strided_shape(r["shape"], stride)) for r in rows)


def wanted(mode: str, device: torch.device, rows: list[dict], stride) -> bool:
    """`data.resident`: "always" on the CPU or CUDA, "never" never, "auto" on CUDA when the strided
    volumes take at most FREE_SHARE of this process's free device memory (Trainer.wants_resident
    makes every process agree). "always" on XLA is refused (not_on_xla)."""
    if mode == "always":
        not_on_xla(device, "data.resident=always")
        return True
    if mode == "never" or device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return strided_bytes(rows, stride) <= FREE_SHARE * free


def not_on_xla(device: torch.device, what: str) -> None:
    """Refuse resident volumes on XLA: the crop was built and tested for one process's device, not
    for SPMD, where the loader shards every batch tensor over the hosts' mesh and each host would
    hold every volume; `data.resident: never` keeps the production loader."""
    if device.type == "xla":
        raise UsageError(f"{what}: resident volumes are not supported on XLA (the device crop is not built for "
                         "SPMD's sharded batches); set data.resident=never")


def on_resume(mode: str, recorded: bool | None, device: torch.device, say) -> bool | None:
    """The path a resume takes, from the one the checkpoint's run took (`recorded`; None in a
    checkpoint from before it was recorded): kept under `auto`, since the two paths draw different
    crops for one (seed, epoch, index) (MONAI in the workers, draw_box here) and a resume on the
    other would not be exact; None (decide now) under `always` or `never`, which the user set, said
    through `say` when it changes the path."""
    if mode == "auto" or recorded is None:
        if recorded:
            not_on_xla(device, "this run's checkpoints were made with resident volumes (data.resident)")
        return recorded
    if (mode == "always") != recorded:
        say(f"resume: data.resident={mode}, but the run so far "
            f"{'cut its crops from resident volumes' if recorded else 'cropped in the loader'}: its crops from here "
            "differ from an uninterrupted run's")
    return None


class ResidentVolumes:
    """Every row's strided volume in one uint8 tensor [n, D, H, W] on `device` (rows of one shape)."""

    def __init__(self, cache: str, rows: list[dict], stride, device: torch.device, progress: bool = False):
        shape = data.strided_shape(rows[0]["shape"], stride)
        self.volumes = torch.empty((len(rows), *shape), dtype=torch.uint8, device=device)
        for i, r in enumerate(tqdm(rows, desc="volumes to the device", unit="vol", disable=not progress,
                                   dynamic_ncols=True)):
            v = data.read_strided(cache, r, stride)
            if list(v.shape) != shape:
                raise ValueError(f"{r['relpath']}: cached shape {list(v.shape)} differs from {shape} "
                                 "(data.resident needs one shape; set data.resident=never)")
            self.volumes[i].copy_(torch.from_numpy(v))

    def crops(self, index: torch.Tensor, box: torch.Tensor, flip: torch.Tensor, shape) -> torch.Tensor:
        """uint8 [B, 1, *shape]: per sample the box (start d, h, w, size d, h, w) of its volume,
        resized to `shape` and flipped left-right where `flip`. Device ops only (no host read of
        the boxes), so the host queues the step behind it without waiting."""
        dev = self.volumes.device
        index, box, flip = index.to(dev), box.to(dev).float(), flip.to(dev)
        vol = self.volumes.index_select(0, index)[:, None].float()               # [B, 1, D, H, W]
        axes = []
        for a, (n_out, n_full) in enumerate(zip(shape, vol.shape[2:])):
            start, size = box[:, a:a + 1], box[:, 3 + a:4 + a]
            i = torch.arange(n_out, device=dev, dtype=torch.float32) + 0.5
            src = ((i * size / n_out) - 0.5).clamp(min=0)                      # F.interpolate's source voxel
            src = torch.minimum(src, size - 1) + start
            axes.append(2 * (src + 0.5) / n_full - 1)                          # grid_sample's coordinate
        d, h, w = axes
        w = torch.where(flip[:, None], w.flip(-1), w)
        grid = torch.stack(torch.broadcast_tensors(w[:, None, None, :], h[:, None, :, None], d[:, :, None, None]), -1)
        out = F.grid_sample(vol, grid, mode="bilinear", align_corners=False)   # trilinear on a 5-D input
        return out.round_().clamp_(0, 255).to(torch.uint8)
