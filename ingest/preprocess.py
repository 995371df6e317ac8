"""Normalise and resample a decoded OCT volume into the cache's uint8 grid.

Window: quantiles [p_lo, p_hi] from a strided subsample (about `window_samples` voxels),
computed exactly from a histogram for integer data. Then clip, rescale to 0..255, resize
to the target grid with antialiasing (separable weight matrices: frames in float32 slabs to
bound memory, then rows and columns), and flip devices into one orientation.
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
    slab_frames: int = 16                                  # source frames in float32 at once (memory bound)
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


def aa_weights(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] float32 weights of an antialiased linear resize along one axis: the
    triangle filter widened by the scale when shrinking, rows normalised to sum 1; the same
    weights torch's F.interpolate(mode="bilinear", antialias=True, align_corners=False) uses."""
    scale = n_in / n_out
    support, inv = (scale, 1.0 / scale) if scale >= 1 else (1.0, 1.0)
    center = scale * (np.arange(n_out) + 0.5)
    x0 = np.maximum((center - support + 0.5).astype(np.int64), 0)        # int(): truncation, as torch
    x1 = np.minimum((center + support + 0.5).astype(np.int64), n_in)
    j = np.arange(n_in)
    weights = np.clip(1.0 - np.abs((j[None, :] - center[:, None] + 0.5) * inv), 0.0, None)
    weights[(j[None, :] < x0[:, None]) | (j[None, :] >= x1[:, None])] = 0.0
    weights /= weights.sum(axis=1, keepdims=True)
    return weights.astype(np.float32)


def input_span(weights: np.ndarray) -> tuple[int, int]:
    """First and one-past-last input index with a nonzero weight in these rows."""
    used = np.flatnonzero(weights.any(axis=0))
    return int(used[0]), int(used[-1]) + 1


def bands(weights: np.ndarray, rows: int = 16) -> list[tuple[int, int, int, int, "torch.Tensor"]]:
    """A banded weight matrix as blocks of `rows` outputs, each with the inputs it reads:
    (out0, out1, in0, in1, dense block). Multiplying the blocks skips the zeros outside
    the band, which would be most of the work of one dense product."""
    import torch
    out = []
    for o0 in range(0, weights.shape[0], rows):
        o1 = min(o0 + rows, weights.shape[0])
        i0, i1 = input_span(weights[o0:o1])
        out.append((o0, o1, i0, i1, torch.from_numpy(np.ascontiguousarray(weights[o0:o1, i0:i1]))))
    return out


def frame_blocks(weights: np.ndarray, max_inputs: int) -> list[tuple[int, int, int, int]]:
    """Consecutive output frames grouped while the input frames they read span at most
    `max_inputs` (at least one output each): (out0, out1, in0, in1)."""
    blocks: list[tuple[int, int, int, int]] = []
    j0 = 0
    while j0 < weights.shape[0]:
        j1 = j0 + 1
        while j1 < weights.shape[0] and np.subtract(*input_span(weights[j0:j1 + 1])[::-1]) <= max_inputs:
            j1 += 1
        blocks.append((j0, j1, *input_span(weights[j0:j1])))
        j0 = j1
    return blocks


def rescale_resize(pixels: np.ndarray, lo: float, hi: float, target: tuple[int, int, int],
                   slab_frames: int = 16) -> np.ndarray:
    """Clip to [lo, hi], map to 0..255 and resample to `target` with antialiasing, as uint8.

    Separable, as matrix products (BLAS): frames first, in blocks whose input frames span at
    most `slab_frames`, converted into one reused float32 buffer (no float copy of the
    volume, no fresh allocation per block: first-touch page faults cost more than the
    arithmetic); then rows and columns of the few output frames as banded products. Clipping
    is the only non-linear step and comes first, as in reference_resize; the map to 0..255
    folds into the frame weights and, as every weight row sums to 1, the offset `lo` is
    subtracted once from the small output instead of from every source voxel."""
    import torch  # here, not at module top: the driver process never needs it

    frames, rows, cols = pixels.shape
    d, h, w = target
    scale = 255.0 / (hi - lo)
    frame_w = aa_weights(frames, d) * np.float32(scale)
    blocks = frame_blocks(frame_w, slab_frames)
    n_in, n_out = max(b[3] - b[2] for b in blocks), max(b[1] - b[0] for b in blocks)
    row_bands = bands(aa_weights(rows, h)) if rows != h else None
    col_bands = bands(aa_weights(cols, w)) if cols != w else None
    buf = np.empty((n_in, rows, cols), np.float32)
    x = torch.from_numpy(buf)
    y = torch.empty((n_out, rows, cols))
    t = torch.empty((n_out, h, cols)) if row_bands else y
    z = torch.empty((n_out, h, w)) if col_bands else t
    out = np.empty((d, h, w), np.uint8)
    for j0, j1, k0, k1 in blocks:
        nk, nj = k1 - k0, j1 - j0
        np.copyto(buf[:nk], pixels[k0:k1], casting="unsafe")  # numpy: `pixels` may be a flipped view
        x[:nk].clamp_(lo, hi)
        torch.mm(torch.from_numpy(frame_w[j0:j1, k0:k1]), x[:nk].view(nk, -1), out=y[:nj].view(nj, -1))
        for o0, o1, i0, i1, band in row_bands or ():
            torch.matmul(band, y[:nj, i0:i1], out=t[:nj, o0:o1])
        for o0, o1, i0, i1, band in col_bands or ():
            torch.matmul(t[:nj, :, i0:i1], band.T, out=z[:nj, :, o0:o1])
        out[j0:j1] = z[:nj].sub_(lo * scale).round_().clamp_(0, 255).numpy()
    return out


def reference_resize(pixels: np.ndarray, lo: float, hi: float, target: tuple[int, int, int]) -> np.ndarray:
    """The float32 path rescale_resize replaced (clip, map, F.interpolate with antialias:
    B-scans, then across frames): the fidelity reference for tests and `make bench`."""
    import torch
    import torch.nn.functional as F

    frames, rows, cols = pixels.shape
    d, h, w = target
    x = torch.from_numpy(np.ascontiguousarray(pixels).astype(np.float32))
    x = x.sub_(lo).mul_(255.0 / (hi - lo)).clamp_(0, 255)
    if (rows, cols) != (h, w):
        x = F.interpolate(x[:, None], size=(h, w), mode="bilinear", antialias=True, align_corners=False)[:, 0]
    if frames != d:
        x = F.interpolate(x.reshape(1, 1, frames, h * w), size=(d, h * w), mode="bilinear",
                          antialias=True, align_corners=False).reshape(d, h, w)
    return x.round_().clamp_(0, 255).to(torch.uint8).numpy()


def level_agreement(new: np.ndarray, ref: np.ndarray) -> tuple[float, int]:
    """(fraction of voxels within 1 level, largest difference) between two uint8 volumes."""
    diff = np.abs(new.astype(np.int16) - ref.astype(np.int16))
    return float((diff <= 1).mean()), int(diff.max())


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
