"""Where each B-scan of an OCT file lies: its scan pattern and its orientation, from the header.

DICOM gives every frame of an ophthalmic tomography image an Ophthalmic Frame Location Sequence
(0022,0031): the frame's trace on the localizer image (the fundus picture), as Reference
Coordinates (0022,0032) in (row, column) pairs. A LINEAR frame is a line segment given by its two
end points. From the traces:

- raster: parallel lines at distinct offsets (a volume);
- radial: lines at different angles through one centre (a radial scan; circles may come with it);
- line: every frame on one line (repeated B-scans), or a single frame.

The common orientation for raster volumes: frames in increasing localizer row (top to bottom of
the fundus image) and each B-scan's columns in increasing localizer column (left to right); a file
written the other way round is flipped before resampling. Files without traces keep their order
(configs/cache.yaml `preprocess.orientation` rules still apply).
"""
from __future__ import annotations

import numpy as np

from manifests.protocols import LINE, RADIAL, RASTER

PARALLEL_SIN = 0.05       # lines within about 3 degrees count as parallel
SAME_LINE = 0.01          # offsets within 1% of a line's length count as one position
CENTRE_SPREAD = 0.15      # radial: every midpoint within 15% of a line's length of their mean


def frame_traces(ds) -> list[np.ndarray] | None:
    """Each frame's Reference Coordinates as an [n, 2] array of (row, column) points, or None
    when the file has no trace for some frame."""
    groups = ds.get("PerFrameFunctionalGroupsSequence")
    if not groups:
        return None
    out = []
    for g in groups:
        loc = g.get("OphthalmicFrameLocationSequence")
        coords = loc[0].get("ReferenceCoordinates") if loc else None
        try:
            values = [float(v) for v in coords]   # a single value is not a sequence: TypeError
        except (TypeError, ValueError):
            return None
        if len(values) < 2 or len(values) % 2 or not np.isfinite(values).all():
            return None
        out.append(np.asarray(values, dtype=np.float64).reshape(-1, 2))
    return out


def _lines(traces: list[np.ndarray]) -> np.ndarray:
    """[n, 2, 2]: the straight traces (two points each, of some length) as (start, end)."""
    lines = [t for t in traces if len(t) == 2 and np.linalg.norm(t[1] - t[0]) > 0]
    return np.stack(lines) if lines else np.empty((0, 2, 2))


def scan_pattern(traces: list[np.ndarray] | None) -> str | None:
    """raster, radial or line from the frames' traces; None when they say none of these."""
    if not traces:
        return None
    lines = _lines(traces)
    curved = sum(len(t) > 2 for t in traces)   # a trace of many points: a circle or another curve
    if len(lines) == 0:
        return None
    if len(traces) == 1:
        return LINE
    start, end = lines[:, 0], lines[:, 1]
    vec = end - start
    length = float(np.median(np.linalg.norm(vec, axis=1)))
    if length <= 0:
        return None
    unit = vec / np.linalg.norm(vec, axis=1, keepdims=True)
    ref = unit[int(np.argmax(np.linalg.norm(vec, axis=1)))]    # the longest line's direction
    mid = (start + end) / 2
    sin = np.abs(unit[:, 0] * ref[1] - unit[:, 1] * ref[0])
    if sin.max() < PARALLEL_SIN and not curved:
        normal = np.array([-ref[1], ref[0]])
        offsets = mid @ normal
        return LINE if np.ptp(offsets) < SAME_LINE * length else RASTER
    spread = np.linalg.norm(mid - mid.mean(axis=0), axis=1).max()
    if sin.max() >= PARALLEL_SIN and spread < CENTRE_SPREAD * length:
        return RADIAL
    return None


def raster_aspect(traces: list[np.ndarray] | None) -> float | None:
    """A raster's extent across frames over its length along B-scans, in the localizer's own units
    (so unit-free: the localizer's pixel size is not in the file). First to last line span n - 1
    frame steps, scaled to n as the header's spacing x frames is. None when not a raster."""
    if scan_pattern(traces) != RASTER:
        return None
    lines = _lines(traces)
    vec = lines[:, 1] - lines[:, 0]
    length = float(np.median(np.linalg.norm(vec, axis=1)))
    unit = vec[0] / np.linalg.norm(vec[0])
    mid = lines.mean(axis=1)
    across = abs(float((mid[-1] - mid[0]) @ np.array([-unit[1], unit[0]])))
    n = len(lines)
    return across * n / (n - 1) / length if n > 1 and length > 0 and across > 0 else None


def raster_flips(traces: list[np.ndarray] | None) -> list[int]:
    """Axes (0 frames, 2 columns) to reverse so a raster volume's frames run down the localizer and
    its B-scans left to right: from the traces' order and direction. [] when not a raster."""
    if scan_pattern(traces) != RASTER:
        return []
    lines = _lines(traces)
    vec = lines[:, 1] - lines[:, 0]
    mid = lines.mean(axis=1)
    along = 1 if abs(vec[:, 1].mean()) >= abs(vec[:, 0].mean()) else 0   # columns (horizontal B-scans) or rows
    across = 1 - along
    flips = []
    if mid[-1, across] < mid[0, across]:
        flips.append(0)
    if vec[:, along].mean() < 0:
        flips.append(2)
    return flips
