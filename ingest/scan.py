"""What one OCT file is, read from every witness it carries, and what to do when they disagree.

- Protocol: the header's Protocol Name, else the file name's id, else the shape (frames, rows,
  columns) against the published table, as AI-READI's own classifier tells protocols apart.
- Pattern: the frames' traces on the localizer (ingest/geometry.py), else the protocol's.
- Geometry, three witnesses per axis: the header's spacing x shape, the protocol's published field,
  and the traces (their extent across frames over their length along the B-scan is the field's
  aspect: unit-free, as the localizer's pixel size is not in the file). Where they disagree by more
  than a tenth (protocols.GEOMETRY_TOLERANCE) the row gets a `geometry_warning` naming each witness
  and value, and the resample takes the witness `preprocess.geometry` names (published: the
  published field where there is one, which repairs the Cirrus macular cube whose converter wrote
  the column spacing as Slice Thickness; header: the header's spacing).
- Orientation: the traces decide where they exist; else AI-READI's documented reversal of a
  protocol (Spectralis OCTA), then the configured rules (preprocess.orientation). A documented
  reversal that the traces contradict is a `geometry_warning`; `flipped` says what was done, why.

Every input of this reading is in this file, ingest/geometry.py, ingest/dicom.py and
manifests/protocols.py: a saved reading is reused only while they are unchanged (reading_key).
"""
from __future__ import annotations

import dataclasses
import functools
import math

from ingest import geometry
from manifests import protocols
from manifests.protocols import RADIAL, RASTER

READING_CODE = ("ingest/scan.py", "ingest/dicom.py")   # their import closure reads a header


@functools.lru_cache(maxsize=1)
def reading_key() -> str:
    """The content key of the code that reads a header (this module's closure)."""
    from octfm import config
    return config.code_key(READING_CODE)


@dataclasses.dataclass
class Scan:
    protocol: str | None
    protocol_by: str | None          # header | name | shape | None (nothing told it)
    pattern: str | None
    field_mm: list[float | None]     # the extent per axis the resample uses (None: not known)
    spacing: tuple | None            # the voxel size (frame, row, col) in mm the resample uses; NaN: not known
    flips: list[int]                 # axes reversed to the common orientation
    flipped: str | None              # which axes, and which witness said so
    geometry_warning: str | None
    mismatch: str | None             # the file name's protocol where the header names another one
    native_shape: list[int]


@dataclasses.dataclass
class Classified:
    protocol: str | None
    by: str | None                   # header | name | shape | None
    mismatch: str | None = None      # the file name's protocol where the header names another one
    pattern: str | None = None       # the protocol's, or the one every protocol of its shape shares
    field: list | None = None        # the published field, or the one every protocol of its shape shares


def classify(header, row: dict) -> Classified:
    """The header's Protocol Name where the table knows it, else the file name's (Zeiss keeps its own
    names in Cirrus headers), else the shape's match. A shape several protocols share (Maestro2's
    wide and macular cubes, the two Cirrus 6x6 OCTA cubes) is told apart by the row's region; left
    ambiguous, it names no protocol but still gives the pattern and field they share, if they do."""
    named, by_name = protocols.lookup(header.protocol_name), row.get("protocol")
    by_name = by_name if protocols.known(by_name) else None
    for protocol, by in ((named, "header"), (by_name, "name")):
        if protocol:
            mismatch = by_name if by == "header" and by_name and by_name != named else None
            return Classified(protocol, by, mismatch, protocols.published_pattern(protocol),
                              protocols.published_field(protocol))
    hits = protocols.by_shape((header.frames, header.rows, header.cols), row.get("device"),
                              protocols.region_word(row.get("anatomic_region")))
    patterns = {p.pattern for p in hits}
    fields = {p.field_mm for p in hits}
    shared = Classified(None, "shape" if hits else None, pattern=patterns.pop() if len(patterns) == 1 else None,
                        field=protocols.published_field(hits[0].name) if len(fields) == 1 else None)
    if len(hits) == 1:
        shared.protocol = hits[0].name
    elif not shared.pattern:
        shared.by = None
    if shared.protocol is None:
        shared.protocol = protocols.canonical(header.protocol_name) or row.get("protocol")
    return shared


def geometry_of(header, published: list | None, pattern: str | None, source: str) -> tuple[list, list, str | None]:
    """(spacing, field, warning): the voxel size and extent per axis the resample uses, from the
    witness `source` names first, and the disagreements among the witnesses."""
    shape = (header.frames, header.rows, header.cols)
    spacing_h = list(header.spacing_mm or (float("nan"),) * 3)
    said = {"header": [s * n if s > 0 else None for s, n in zip(spacing_h, shape)],
            "published": published or [None, None, None]}
    aspect = geometry.raster_aspect(header.traces)
    along = said["header"][2] or said["published"][2]
    said["traces"] = [aspect * along if aspect and along else None, None, None]
    order = (source, *(w for w in ("published", "header") if w != source), "traces")
    field, warnings = [], []
    for axis in range(3):
        known = {w: said[w][axis] for w in order if said[w][axis] is not None}
        chosen = next(iter(known), None)
        field.append(known.get(chosen))
        if pattern == RADIAL and axis == 0:
            field[0] = None   # a radial scan has no extent across its frames
            continue
        differ = protocols.disagreement(protocols.AXES[axis], known, {"header": f" ({shape[axis]} x {spacing_h[axis]:.4g})"})
        if differ:
            warnings.append(f"{differ}; used {chosen}")
    spacing = [f / n if f else float("nan") for f, n in zip(field, shape)]
    return spacing, field, ("geometry: " + "; ".join(warnings)) if warnings else None


def orientation(header, traced: str | None, protocol: str | None, row: dict,
                rules) -> tuple[list[int], str | None, str | None]:
    """(axes to reverse, what was done and why, a warning when a documented rule and the traces
    disagree); `traced`: the pattern the frames' traces show (geometry.scan_pattern), if any."""
    known = protocols.known(protocol)
    documented = bool(known and known.frames_reversed)
    if traced == RASTER:
        axes = geometry.raster_flips(header.traces)
        warning = None
        if documented and 0 not in axes:
            warning = (f"orientation: AI-READI documents {protocol}'s frames as reversed, but their traces run top "
                       "to bottom: the traces were followed")
        return axes, _said(axes, "its frames' traces"), warning
    axes = {0} if documented else set()
    why = [f"AI-READI's documented reversal of {protocol}"] if documented else []
    text = " ".join(str(v or "") for v in (protocol, row.get("imaging"), row.get("anatomic_region"),
                                            (row.get("relpath") or "").rsplit("/", 1)[-1])).lower()
    for rule in rules:
        if rule.device == row.get("device") and rule.match.lower() in text:
            axes ^= set(rule.axes)
            why.append(f"preprocess.orientation rule {{device: {rule.device}, match: {rule.match!r}}}")
    axes = sorted(axes)
    return axes, _said(axes, " then ".join(why)) if why else None, None


def _said(axes: list[int], why: str) -> str | None:
    if not axes:
        return None
    names = {0: "frames", 1: "rows", 2: "columns"}
    return f"{', '.join(names[a] for a in axes)} reversed ({why})"


def describe(header, row: dict, geometry_source: str = "published", rules=()) -> Scan:
    """Every witness of `header` (ingest.dicom.Header) and the manifest `row` read into one Scan."""
    c = classify(header, row)
    traced = geometry.scan_pattern(header.traces)
    pattern = traced or c.pattern
    spacing, field, warning = geometry_of(header, c.field, pattern, geometry_source)
    flips, flipped, turned = (orientation(header, traced, c.protocol, row, rules) if pattern == RASTER
                              else ([], None, None))
    warning = "; ".join(w for w in (warning, turned) if w) or None
    field = [round(f, 4) if f else None for f in field]
    known = any(not math.isnan(s) for s in spacing)
    return Scan(c.protocol, c.by, pattern, field, tuple(spacing) if known else None, flips, flipped, warning,
                c.mismatch, [header.frames, header.rows, header.cols])
