"""Normalise and resample a decoded OCT volume into the cache's uint8 grid.

Window: quantiles [p_lo, p_hi] from a strided subsample (about `window_samples` voxels),
computed exactly from a histogram for integer data. Then clip, rescale to 0..255, resize
to the target grid with antialiasing (B-scans first, then across frames, in float32 slabs
to bound memory), and flip devices into one orientation.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ingest.dicom import BadInput

# Bump when anything below changes the cached bytes: every cache key includes it.
CODE_VERSION = "3"  # 2: orientation flips happen before resampling; 3: volumes are OME-Zarr images (cache.store)


@dataclasses.dataclass
class FlipRule:
    """Reverse `axes` (0 frames, 1 rows, 2 cols) of volumes of `device` whose protocol matches."""
    device: str
    match: str = ""          # substring of "<imaging> <anatomic_region> <file name>", lower case
    axes: list[int] = dataclasses.field(default_factory=lambda: [0])


@dataclasses.dataclass
class PreprocessConfig:
    target_shape: tuple[int, int, int] = (64, 384, 384)   # D, H, W
    percentiles: tuple[float, float] = (1.0, 99.0)
    window_samples: int = 1_000_000                        # voxels in the strided subsample
    decoder: str = "auto"                                  # auto | gdcm | pylibjpeg | pillow
    max_voxels: int = 512 * 1024 * 1024                    # refuse larger headers before decoding
    accept_any_sop: bool = False                           # test hook: MR files relabelled as OPT
    slab_frames: int = 16                                  # frames resized at once (memory bound)
    orientation: list[FlipRule] = dataclasses.field(
        default_factory=lambda: [FlipRule(device="heidelberg_spectralis", match="octa", axes=[0])])


def subsample_strides(shape: tuple[int, ...], target: int) -> tuple[int, ...]:
    """Per-axis strides so the strided view holds about `target` voxels, thinning the
    longest sampled axis first (frames are few; rows and columns are many)."""
    strides = [1] * len(shape)
    while math.prod(math.ceil(n / s) for n, s in zip(shape, strides)) > target:
        extents = [math.ceil(n / s) for n, s in zip(shape, strides)]
        axis = int(np.argmax(extents))
        if extents[axis] <= 1:
            break
        strides[axis] += 1
    return tuple(strides)


def quantiles(values: np.ndarray, percentiles) -> tuple[float, ...]:
    """Percentiles with numpy's 'linear' rule; exact and O(n) through a histogram for
    unsigned integers (OCT is 8 or 16 bit), np.percentile otherwise."""
    flat = values.reshape(-1)
    if flat.size == 0:
        raise BadInput("empty volume: no voxels")
    if flat.dtype.kind != "u":
        return tuple(float(v) for v in np.percentile(flat, percentiles))
    counts = np.bincount(flat)
    cum = np.cumsum(counts)
    n = cum[-1]
    out = []
    for p in percentiles:
        pos = p / 100.0 * (n - 1)
        lo_i, frac = int(math.floor(pos)), pos - math.floor(pos)
        v_lo = int(np.searchsorted(cum, lo_i, side="right"))
        v_hi = int(np.searchsorted(cum, min(lo_i + 1, n - 1), side="right"))
        out.append(v_lo + frac * (v_hi - v_lo))
    return tuple(out)


def subsample(pixels: np.ndarray, target: int) -> np.ndarray:
    """A strided view of about `target` voxels, each stride started at its middle (no copy)."""
    strides = subsample_strides(pixels.shape, target)
    return pixels[tuple(slice(s // 2, None, s) for s in strides)]


def window(pixels: np.ndarray, cfg: PreprocessConfig) -> tuple[float, float]:
    """The normalisation window from the strided subsample."""
    lo, hi = quantiles(np.ascontiguousarray(subsample(pixels, cfg.window_samples)), cfg.percentiles)
    return lo, hi


def full_window(pixels: np.ndarray, cfg: PreprocessConfig) -> tuple[float, float]:
    """The window over every voxel (reference for tests and the benchmark)."""
    return quantiles(pixels, cfg.percentiles)


def rescale_resize(pixels: np.ndarray, lo: float, hi: float, target: tuple[int, int, int],
                   slab_frames: int = 16) -> np.ndarray:
    """Clip to [lo, hi], map to 0..255 and resample to `target`, returning uint8."""
    import torch  # here, not at module top: the driver process never needs it
    import torch.nn.functional as F

    frames, rows, cols = pixels.shape
    d, h, w = target
    scale = 255.0 / (hi - lo)
    plane = torch.empty((frames, h, w), dtype=torch.float32)
    for f0 in range(0, frames, slab_frames):
        x = torch.from_numpy(pixels[f0:f0 + slab_frames].astype(np.float32))
        x.sub_(lo).mul_(scale).clamp_(0, 255)
        if (rows, cols) != (h, w):
            x = F.interpolate(x[:, None], size=(h, w), mode="bilinear", antialias=True, align_corners=False)[:, 0]
        plane[f0:f0 + slab_frames] = x
    if frames != d:
        plane = F.interpolate(plane.reshape(1, 1, frames, h * w), size=(d, h * w), mode="bilinear",
                              antialias=True, align_corners=False).reshape(d, h, w)
    return plane.round_().clamp_(0, 255).to(torch.uint8).numpy()


def flip_axes(device: str | None, protocol: str, rules: list[FlipRule]) -> list[int]:
    """Axes to reverse for this device and protocol under the configured rules."""
    axes: set[int] = set()
    text = protocol.lower()
    for rule in rules:
        if rule.device == device and rule.match.lower() in text:
            axes ^= set(rule.axes)
    return sorted(axes)


def preprocess(pixels: np.ndarray, cfg: PreprocessConfig, flip: list[int] = ()) -> tuple[np.ndarray, float, float]:
    """Decoded volume -> (uint8 volume at cfg.target_shape, lo, hi)."""
    lo, hi = window(pixels, cfg)
    if not hi > lo:
        raise BadInput(f"constant volume: window lo == hi == {lo:g} (no image content to normalise)")
    if flip:  # before resampling (a view): a reversed source then caches exactly like its upright twin
        pixels = np.flip(pixels, axis=tuple(flip))
    out = rescale_resize(pixels, lo, hi, tuple(cfg.target_shape), cfg.slab_frames)
    return out, lo, hi


def output_spacing(native_spacing, native_shape, target_shape) -> list[float] | None:
    """Voxel size after resampling: the physical extent is kept."""
    if native_spacing is None:
        return None
    return [float(s) * n / t for s, n, t in zip(native_spacing, native_shape, target_shape)]
