"""Normalise and resample a decoded OCT volume into the cache's uint8 grid.

Window: quantiles [p_lo, p_hi] from a strided subsample (about `window_samples` voxels),
computed exactly from a histogram for integer data. Then clip, rescale to 0..255 and resample
with antialiasing (separable weight matrices: frames in float32 slabs to bound memory, then rows
and columns), after flipping the volume into the common orientation.

Two ways to resample (`resample`): `grid` stretches every volume onto `target_shape`, whatever
its field; `spacing` resamples to a fixed voxel size `spacing_mm` and centre-crops or pads to
`target_shape`, so a layer is as many voxels thick on every scanner and a 12 mm field shows twice
the anatomy of a 6 mm one (docs/data.md, "Resampling").
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ingest.dicom import BadInput
from manifests.protocols import AXES

# Bump when anything below changes the cached bytes: every cache key includes it.
CODE_VERSION = "5"  # 2: orientation flips happen before resampling; 3: volumes are OME-Zarr images (cache.store);
# 4: raster volumes flipped by their frames' traces on the localizer (ingest/geometry.py); 5: a scan's geometry
# and orientation from all its witnesses (ingest/scan.py: Cirrus's published field, Spectralis OCTA reversed)
RESAMPLE_MODES = ("grid", "spacing")
GEOMETRY_SOURCES = ("published", "header")   # which witness of a scan's extent the resample believes (ingest/scan.py)
MIN_FILL = 0.5   # resample: spacing: a file must fill at least this fraction of the target along every axis


@dataclasses.dataclass
class FlipRule:
    """Reverse `axes` (0 frames, 1 rows, 2 cols) of volumes of `device` whose protocol matches."""
    device: str
    match: str = ""          # substring of "<imaging> <anatomic_region> <file name>", lower case
    axes: list[int] = dataclasses.field(default_factory=lambda: [0])


@dataclasses.dataclass
class PreprocessConfig:
    target_shape: tuple[int, int, int] = (64, 384, 384)   # D, H, W
    resample: str = "grid"                                 # grid | spacing (module docstring)
    spacing_mm: tuple[float, float, float] = (0.1, 0.006, 0.02)  # resample: spacing: voxel size D, H, W
    # the extent a scan's voxel size comes from where its witnesses disagree: the protocol's published field
    # (the header where none is published) or the header's spacing (ingest/scan.py)
    geometry: str = "published"
    percentiles: tuple[float, float] = (1.0, 99.0)
    window_samples: int = 1_000_000                        # voxels in the strided subsample
    decoder: str = "auto"                                  # auto | gdcm | pylibjpeg | pillow
    max_voxels: int = 512 * 1024 * 1024                    # refuse larger headers before decoding
    accept_any_sop: bool = False                           # test hook: MR files relabelled as OPT
    slab_frames: int = 16                                  # source frames in float32 at once (memory bound)
    # flips for files whose frames carry no trace on the localizer (traced raster volumes are oriented from it)
    orientation: list[FlipRule] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        from octfm.config import FieldError

        if self.resample not in RESAMPLE_MODES:
            raise FieldError("resample", f"{self.resample!r} is not one of {list(RESAMPLE_MODES)}")
        if self.geometry not in GEOMETRY_SOURCES:
            raise FieldError("geometry", f"{self.geometry!r} is not one of {list(GEOMETRY_SOURCES)}")
        if len(self.spacing_mm) != 3 or min(self.spacing_mm) <= 0:
            raise FieldError("spacing_mm", f"{list(self.spacing_mm)}: three voxel sizes in mm (D, H, W), each > 0")


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


def aa_weights(n_in: int, n_out: int, scale: float | None = None) -> np.ndarray:
    """[n_out, n_in] float32 weights of an antialiased linear resize along one axis: the
    triangle filter widened by the scale when shrinking, rows normalised to sum 1; the same
    weights torch's F.interpolate(mode="bilinear", antialias=True, align_corners=False) uses.
    `scale` (input voxels per output voxel; default n_in / n_out) fixes the output voxel size
    instead (spacing_axis); a row that would read no input stays all zeros rather than dividing by 0."""
    scale = n_in / n_out if scale is None else scale
    support, inv = (scale, 1.0 / scale) if scale >= 1 else (1.0, 1.0)
    center = scale * (np.arange(n_out) + 0.5)
    x0 = np.maximum((center - support + 0.5).astype(np.int64), 0)        # int(): truncation, as torch
    x1 = np.minimum((center + support + 0.5).astype(np.int64), n_in)
    j = np.arange(n_in)
    weights = np.clip(1.0 - np.abs((j[None, :] - center[:, None] + 0.5) * inv), 0.0, None)
    weights[(j[None, :] < x0[:, None]) | (j[None, :] >= x1[:, None])] = 0.0
    sums = weights.sum(axis=1, keepdims=True)
    weights /= np.where(sums > 0, sums, 1.0)
    return weights.astype(np.float32)


@dataclasses.dataclass
class AxisPlan:
    """How one axis is resampled: weights [n_kept, n_in], where the kept outputs start in the
    stored axis, and the voxels padded (+) or cut (-) to reach the stored size."""
    weights: np.ndarray
    offset: int = 0
    crop_pad: int = 0
    identity: bool = False    # the axis is kept as it is (no product needed)


def grid_axis(n_in: int, n_out: int) -> AxisPlan:
    """`grid`: the whole axis stretched onto n_out voxels."""
    if n_in == n_out:
        return AxisPlan(np.eye(n_in, dtype=np.float32), identity=True)
    return AxisPlan(aa_weights(n_in, n_out))


def spacing_axis(n_in: int, spacing_in: float, spacing_out: float, n_out: int) -> AxisPlan:
    """`spacing`: resampled to voxels of `spacing_out` mm (about n_in * spacing_in / spacing_out of
    them), then centre-cropped or padded to n_out; only the kept outputs are computed."""
    scale = spacing_out / spacing_in
    n_res = max(1, round(n_in / scale))
    w = aa_weights(n_in, n_res, scale)
    diff = n_out - n_res
    if diff < 0:
        start = -diff // 2
        return AxisPlan(w[start:start + n_out], 0, diff)
    return AxisPlan(w, diff // 2, diff)


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
                   slab_frames: int = 16, plans: tuple[AxisPlan, AxisPlan, AxisPlan] | None = None) -> np.ndarray:
    """Clip to [lo, hi], map to 0..255 and resample to `target` with antialiasing, as uint8.
    `plans` (per axis; default: the `grid` stretch onto target) may crop and pad (spacing_axis):
    padded voxels are 0.

    Separable, as matrix products (BLAS): frames first, in blocks whose input frames span at
    most `slab_frames`, converted into one reused float32 buffer (no float copy of the
    volume, no fresh allocation per block: first-touch page faults cost more than the
    arithmetic); then rows and columns of the few output frames as banded products. Clipping
    is the only non-linear step and comes first, as in reference_resize; the map to 0..255
    folds into the frame weights and, as every weight row sums to 1, the offset `lo` is
    subtracted once from the small output instead of from every source voxel. Padding is the
    output's zeros outside the computed block (the plans' offsets)."""
    import torch  # here, not at module top: the driver process never needs it

    frames, rows, cols = pixels.shape
    pf, pr, pc = plans or (grid_axis(frames, target[0]), grid_axis(rows, target[1]), grid_axis(cols, target[2]))
    d, h, w = pf.weights.shape[0], pr.weights.shape[0], pc.weights.shape[0]
    scale = 255.0 / (hi - lo)
    frame_w = pf.weights * np.float32(scale)
    blocks = frame_blocks(frame_w, slab_frames)
    n_in, n_out = max(b[3] - b[2] for b in blocks), max(b[1] - b[0] for b in blocks)
    row_bands = None if pr.identity else bands(pr.weights)
    col_bands = None if pc.identity else bands(pc.weights)
    buf = np.empty((n_in, rows, cols), np.float32)
    x = torch.from_numpy(buf)
    y = torch.empty((n_out, rows, cols))
    t = torch.empty((n_out, h, cols)) if row_bands else y
    z = torch.empty((n_out, h, w)) if col_bands else t
    out = np.zeros(tuple(target), np.uint8)
    rs, cs = slice(pr.offset, pr.offset + h), slice(pc.offset, pc.offset + w)
    for j0, j1, k0, k1 in blocks:
        nk, nj = k1 - k0, j1 - j0
        np.copyto(buf[:nk], pixels[k0:k1], casting="unsafe")  # numpy: `pixels` may be a flipped view
        x[:nk].clamp_(lo, hi)
        torch.mm(torch.from_numpy(frame_w[j0:j1, k0:k1]), x[:nk].view(nk, -1), out=y[:nj].view(nj, -1))
        for o0, o1, i0, i1, band in row_bands or ():
            torch.matmul(band, y[:nj, i0:i1], out=t[:nj, o0:o1])
        for o0, o1, i0, i1, band in col_bands or ():
            torch.matmul(t[:nj, :, i0:i1], band.T, out=z[:nj, :, o0:o1])
        out[pf.offset + j0:pf.offset + j1, rs, cs] = z[:nj].sub_(lo * scale).round_().clamp_(0, 255).numpy()
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


@dataclasses.dataclass
class Resampled:
    volume: np.ndarray            # uint8 at target_shape
    lo: float
    hi: float
    spacing_mm: list[float] | None  # the stored voxel size (None: the source had no spacing, `grid` only)
    crop_pad: list[int] | None      # `spacing`: voxels padded (+) or cut (-) per axis


def axis_plans(shape, spacing, cfg: PreprocessConfig) -> tuple[tuple[AxisPlan, ...], list[float] | None, list[int] | None]:
    """The three axes' plans for this source, the stored voxel size and what was cut or padded."""
    target = tuple(cfg.target_shape)
    if cfg.resample == "grid":
        return (tuple(grid_axis(n, t) for n, t in zip(shape, target)),
                output_spacing(spacing, shape, target), None)
    if spacing is None or any(not (s > 0) for s in spacing):  # NaN too
        missing = [AXES[i] for i, s in enumerate(spacing or (0, 0, 0)) if not (s > 0)]
        raise BadInput(f"no voxel size {' or '.join(missing)}: neither the header nor the protocol's published "
                       "field gives one, so it cannot be resampled to spacing_mm (config key preprocess.resample: "
                       "grid stretches it instead)")
    plans = tuple(spacing_axis(n, s, o, t) for n, s, o, t in zip(shape, spacing, cfg.spacing_mm, target))
    for axis, (n, s, o, t) in enumerate(zip(shape, spacing, cfg.spacing_mm, target)):
        filled = min(t, max(1, round(n * s / o)))
        if filled < MIN_FILL * t:
            raise BadInput(f"geometry: the data would fill {filled} of the {t} voxels {AXES[axis]} ({n * s:.3g} mm at "
                           f"{o:g} mm a voxel), the rest padding (config keys preprocess.spacing_mm, "
                           "preprocess.target_shape; preprocess.geometry chooses the witness of the field)")
    return plans, [float(v) for v in cfg.spacing_mm], [p.crop_pad for p in plans]


def preprocess(pixels: np.ndarray, cfg: PreprocessConfig, flip: list[int] = (),
               spacing: tuple | None = None) -> Resampled:
    """Decoded volume -> the stored uint8 volume at cfg.target_shape, its window and voxel size.
    `spacing`: the source's voxel size (frame, row, col) in mm."""
    lo, hi = window(pixels, cfg)
    if not hi > lo:
        raise BadInput(f"constant volume: window lo == hi == {lo:g} (no image content to normalise)")
    plans, out_spacing, crop_pad = axis_plans(pixels.shape, spacing, cfg)
    if flip:  # before resampling (a view): a reversed source then caches exactly like its upright twin
        pixels = np.flip(pixels, axis=tuple(flip))
    out = rescale_resize(pixels, lo, hi, tuple(cfg.target_shape), cfg.slab_frames, plans)
    return Resampled(out, lo, hi, out_spacing, crop_pad)


def output_spacing(native_spacing, native_shape, target_shape) -> list[float | None] | None:
    """Voxel size after resampling (the physical extent is kept); None on an axis whose spacing is
    not known (never NaN: strict JSON readers of the OME metadata refuse it)."""
    if native_spacing is None:
        return None
    return [float(s) * n / t if s > 0 else None for s, n, t in zip(native_spacing, native_shape, target_shape)]
