"""A synthetic AI-READI-shaped OCT dataset for the demo and the tests.

Layered retina with a foveal pit, an optic-disc-side thickening and a vessel shadow (an
up-down marker), multiplicative speckle and log compression, written as OPT multi-frame DICOM
at each scanner's native aspect ratio (scaled down by `scale`). Includes a JPEG 2000 device,
both spacing layouts, flipped Spectralis OCTA cubes, and the bad files real buckets contain.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import dataclasses
import io
import os
import shutil
import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence as DicomSequence
from pydicom.uid import ExplicitVRLittleEndian, JPEG2000Lossless, generate_uid
from tqdm import tqdm

from manifests.aireadi import SITES, STUDY_GROUPS
from octfm import cli, procs

OPT_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.77.1.5.4"


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    shape: tuple[int, int, int]          # frames, rows, cols at native size
    spacing: tuple[float, float, float]  # mm: between frames, rows, cols
    manufacturer: str
    model: str
    short: str
    per_frame_spacing: bool = False      # spacing in per-frame instead of shared groups
    compress: str | None = None          # transfer syntax to write


DEVICES = {
    d.name: d for d in (
        DeviceSpec("heidelberg_spectralis", (61, 496, 768), (0.1200, 0.0039, 0.0114), "Heidelberg Engineering",
                   "Spectralis", "spectralis", per_frame_spacing=True),
        DeviceSpec("topcon_maestro2", (128, 885, 512), (0.0469, 0.0026, 0.0117), "Topcon", "Maestro2", "maestro2",
                   per_frame_spacing=True),
        DeviceSpec("topcon_triton", (256, 992, 512), (0.0469, 0.0026, 0.0234), "Topcon", "Triton", "triton"),
        DeviceSpec("zeiss_cirrus", (128, 1024, 512), (0.0469, 0.0020, 0.0117), "Carl Zeiss Meditec", "Cirrus HD-OCT 5000",
                   "cirrus", compress=JPEG2000Lossless),
    )
}

# Layer stack from the vitreous down: (name, thickness as a fraction of the depth, brightness).
LAYERS = (
    ("rnfl", 0.030, 0.80), ("gcl_ipl", 0.055, 0.55), ("inl", 0.030, 0.28), ("opl", 0.020, 0.55),
    ("onl", 0.060, 0.22), ("ez", 0.010, 0.75), ("rpe", 0.016, 0.95), ("choroid", 0.120, 0.50),
)
VITREOUS, SCLERA = 0.04, 0.15
LAYER_INDEX = {name: i for i, (name, _, _) in enumerate(LAYERS)}

# The learning-check cohorts' class cues (SynthConfig.lesions, SynthConfig.layers).
# Lesions: local, in the macula, as a researcher would look for them in diabetic retinopathy.
# Hyperreflective foci (small bright dots in the inner retina) and intraretinal fluid cysts (dark
# pockets in the INL/OPL) whose expected number per eye grows with the study-group label (0
# healthy ... 3 insulin dependent). Healthy eyes have some too, and counts are Poisson, so single
# eyes overlap between classes (a subtle cue, not a give-away). Rendered as OCT renders them: a
# lesion scales the reflectivity of the tissue it sits in by a contrast drawn per lesion (so a
# focus in a dark layer stays darker than one in a bright layer), with a Gaussian partial-volume
# edge rather than a plateau, before the speckle multiplies lesion and tissue alike; each
# lesion's size is drawn from a range.
FOCI_PER_EYE = (1.5, 2.5, 3.5, 4.5)
CYSTS_PER_EYE = (0.3, 0.6, 0.9, 1.2)
FOCUS_RADII = (0.12, 0.06, 0.018)     # frames (y), columns (x), depth (z): fractions of the [-1,1] / [0,1] axes
CYST_RADII = (0.18, 0.09, 0.02)
FOCUS_CONTRAST = (0.8, 1.6)           # relative change of the layer's reflectivity at a focus centre
CYST_CONTRAST = (-0.9, -0.6)          # ... and at a cyst centre (fluid is dark)
LESION_SIZE = (0.6, 1.6)              # each lesion's radii x a factor drawn log-uniformly from this range
LESION_EDGE = 4.0                     # the profile exp(-1.5 d^2) is cut at d^2 = 4 (2 radii; < 0.3% left)
# Layers: the inner nuclear layer thickens by `layers` x label (relative, at the peak) over a
# Gaussian patch of the macula (radius 0.35-0.6 of the half-width: many B-scans and columns),
# placed at random per eye; the outer nuclear layer below thins by as much, so the retina's total
# thickness, and with it the global statistics, carry nothing of the label. A masked block of
# the patch can be predicted from the visible rest of it: the cue V-JEPA's latent term should learn.
BUMP_RADIUS = (0.35, 0.6)
LESION_TABLE = "lesions.tsv"  # at the cohort's root: where every lesion sits (lesion_table)
LESION_COLUMNS = ("kind", "layer", "y", "x", "z", "radius_y", "radius_x", "radius_z", "contrast")


@dataclasses.dataclass(frozen=True)
class Lesion:
    y: float                  # frame coordinate in [-1, 1]
    x: float                  # column coordinate in [-1, 1]
    layer: str                # centred in this layer's depth at (y, x)
    radii: tuple[float, float, float]
    contrast: float           # relative change of the surrounding reflectivity at the centre


@dataclasses.dataclass(frozen=True)
class Eye:
    """Per-eye anatomy beyond the defaults: lesions, and confounders drawn independently of the label."""
    lesions: tuple[Lesion, ...] = ()
    thickness: float = 1.0    # every layer's thickness scaled by this
    offset: float = 0.0       # added to the reflectivity before speckle (global brightness)
    inl_bump: tuple[float, float, float, float] | None = None  # (y, x, radius, relative INL thickening at the peak)


def _macula_point(rng: np.random.Generator) -> tuple[float, float]:
    """A point in the macula (inside the probes' centre crop) off the foveal pit, where the
    inner layers are thin."""
    while True:
        y, x = rng.uniform(-0.6, 0.6), rng.uniform(-0.55, 0.55)
        if x ** 2 + y ** 2 > 0.06:
            return float(y), float(x)


def _scaled(radii: tuple[float, float, float], size: float) -> tuple[float, float, float]:
    return tuple(r * size for r in radii)


def _lesion(rng: np.random.Generator, layers: list[str], radii, contrast: tuple[float, float], size: float) -> Lesion:
    y, x = _macula_point(rng)
    layer = str(rng.choice(layers))
    factor = size * float(np.exp(rng.uniform(*np.log(LESION_SIZE))))
    return Lesion(y, x, layer, _scaled(radii, factor), float(rng.uniform(*contrast)))


def sample_eye(label: int | None, rng: np.random.Generator, lesions: float = 1.0, size: float = 1.0,
               layers: float = 0.0) -> Eye:
    """An eye of the cohort: lesion counts from the label (`lesions` scales the rates' growth
    with the label; 0: every class like healthy; `size` scales every lesion's radii), a patch
    of thicker inner nuclear layer growing with the label when `layers` > 0, and thickness and
    brightness independent of it."""
    lab = 0 if label is None else int(label)
    rate = lambda table: table[0] + lesions * (table[lab] - table[0])  # noqa: E731
    items = [_lesion(rng, ["gcl_ipl", "inl", "opl"], FOCUS_RADII, FOCUS_CONTRAST, size)
             for _ in range(rng.poisson(rate(FOCI_PER_EYE)))]
    items += [_lesion(rng, ["inl", "opl"], CYST_RADII, CYST_CONTRAST, size)
              for _ in range(rng.poisson(rate(CYSTS_PER_EYE)))]
    eye = Eye(tuple(items), thickness=float(rng.uniform(0.85, 1.15)), offset=float(rng.uniform(-0.04, 0.04)))
    if layers:
        y, x = _macula_point(rng)
        eye = dataclasses.replace(eye, inl_bump=(y, x, float(rng.uniform(*BUMP_RADIUS)), layers * lab))
    return eye


def _paint_lesions(img: np.ndarray, lesions, yf: float, x: np.ndarray, z: np.ndarray, bounds_f: np.ndarray) -> np.ndarray:
    """Scale the reflectivity image [R, C] by each lesion crossing frame coordinate `yf`: by
    1 + contrast at its centre, with a Gaussian partial-volume profile around it. Only the
    columns a lesion can reach are computed (elsewhere its factor is exactly 1)."""
    for les in lesions:
        ry, rx, rz = les.radii
        dy = ((yf - les.y) / ry) ** 2
        if dy >= LESION_EDGE:
            continue
        dx = ((x[0] - les.x) / rx) ** 2                                              # [C]
        cols = np.flatnonzero(dx < LESION_EDGE)   # d2 = dy + dx + dz >= dx: outside these, no change
        if not cols.size:
            continue
        lo, hi = cols[0], cols[-1] + 1
        k = LAYER_INDEX[les.layer]
        zc = (bounds_f[lo:hi, k] + bounds_f[lo:hi, k + 1]) / 2                        # layer middle
        d2 = dy + dx[None, lo:hi] + ((z[:, None] - zc[None, :]) / rz) ** 2
        w = np.where(d2 < LESION_EDGE, np.exp(-1.5 * d2), 0.0)
        img[:, lo:hi] = img[:, lo:hi] * (1.0 + les.contrast * w)
    return img


def scaled_shape(device: str, scale: int) -> tuple[int, int, int]:
    f, r, c = DEVICES[device].shape
    return max(8, round(f / scale)), max(16, round(r / scale)), max(16, round(c / scale))


@dataclasses.dataclass
class VolumeDraws:
    """The random numbers a volume needs from the cohort's one sequential stream: a few scalars
    and the seed of the volume's own noise stream. The speckle and noise floor (most of the
    random numbers) are drawn from that seed where the volume is rendered, so a pool of
    processes draws them in parallel and nothing large crosses a process boundary."""
    tilt: float
    lift: float
    gain: float
    noise: int   # seeds the volume's speckle and noise floor (render_volume)


def draw_volume(shape: tuple[int, int, int], rng: np.random.Generator) -> VolumeDraws:
    tilt, lift, gain = rng.uniform(-0.04, 0.04), rng.uniform(-0.03, 0.03), rng.uniform(0.85, 1.15)
    return VolumeDraws(tilt, lift, gain, int(rng.integers(2 ** 63)))


def frame_noise(rng: np.random.Generator, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """One frame's multiplicative speckle and additive noise floor (speckle first: the stream's order)."""
    speckle = rng.gamma(2.0, 0.5, size=size).astype(np.float32)
    return speckle, np.abs(rng.normal(0.03, 0.02, size=size)).astype(np.float32)


def make_volume(shape: tuple[int, int, int], rng: np.random.Generator, laterality: str = "R",
                label: int | None = None, signal: float = 0.0, eye: Eye | None = None) -> np.ndarray:
    """A retina-like uint8 volume [frames, rows, cols] (`render_volume` of `draw_volume`)."""
    return render_volume(shape, draw_volume(shape, rng), laterality, label, signal, eye)


def layer_bounds(y: np.ndarray, x: np.ndarray, tilt: float, lift: float, laterality: str = "R",
                 label: int | None = None, signal: float = 0.0, eye: Eye | None = None) -> np.ndarray:
    """Depth (fraction of the rows, 0 at the top) of every layer boundary at frame coordinates `y`
    and column coordinates `x` (both in [-1, 1], broadcast): [..., len(LAYERS) + 1], the retinal
    surface first. One formula for rendering and for the lesion table's depths."""
    eye = eye or Eye()
    disc_x = 0.85 if laterality == "R" else -0.85
    r2 = x ** 2 + y ** 2
    fovea = np.exp(-r2 / 0.03)
    surface = 0.36 - 0.08 * x ** 2 - 0.03 * y ** 2 + tilt * x + 0.035 * fovea + lift
    thick, moved = [], 0.0
    for name, t, _ in LAYERS:
        t = np.full_like(surface, t)
        if name == "rnfl":
            t = t * (0.4 + 2.0 * np.exp(-((x - disc_x) ** 2 + y ** 2) / 0.15)) * (1 - 0.8 * fovea)
        elif name in ("gcl_ipl", "inl", "opl"):
            t = t * (1 - 0.85 * fovea)
        if name == "inl" and signal and label is not None:
            t = t + signal * 0.012 * label
        if name == "inl" and eye.inl_bump is not None:   # the layers cue: thicker INL, thinner ONL, same total
            by, bx, br, amp = eye.inl_bump
            moved = t * amp * np.exp(-((x - bx) ** 2 + (y - by) ** 2) / (2 * br ** 2))
            t = t + moved
        elif name == "onl":
            t = t - moved
        thick.append(t * eye.thickness)
    bounds = surface[..., None] + np.cumsum(np.stack(thick, -1), -1)
    return np.concatenate([surface[..., None], bounds], -1)


def lesion_table(draws: VolumeDraws, laterality: str, label: int | None, signal: float, eye: Eye | None) -> list[dict]:
    """Where each lesion of an eye sits, in the rendered (upright) volume's coordinates: frame `y`
    and column `x` in [-1, 1] (linspace over the axis), depth `z` in [0, 1] (row centres at
    (i + 0.5) / rows), the radii on those axes and the kind. The token-level probe reads it
    (evals/token_probe.py); a cache resized over the whole extent keeps these fractions."""
    out = []
    for les in (eye.lesions if eye else ()):
        b = layer_bounds(np.float32(les.y), np.float32(les.x), draws.tilt, draws.lift, laterality, label, signal, eye)
        k = LAYER_INDEX[les.layer]
        out.append({"kind": "focus" if les.contrast > 0 else "cyst", "layer": les.layer, "y": les.y, "x": les.x,
                    "z": float((b[k] + b[k + 1]) / 2), "radius_y": les.radii[0], "radius_x": les.radii[1],
                    "radius_z": les.radii[2], "contrast": les.contrast})
    return out


def render_volume(shape: tuple[int, int, int], draws: VolumeDraws, laterality: str = "R",
                  label: int | None = None, signal: float = 0.0, eye: Eye | None = None) -> np.ndarray:
    """A retina-like uint8 volume [frames, rows, cols] from its random draws.

    `signal` > 0 plants a class cue: the inner nuclear layer thickens with the label, which a
    probe can learn (issue: probes on planted signal).
    A vessel arches from the disc towards frame 0 only and shadows the tissue below it: an
    up-down marker, so a frame-reversed cube shows its arc at the bottom of an en-face image.
    `eye` adds lesions and per-eye thickness and brightness (the learning-check cohort).
    """
    eye = eye or Eye()
    frames, rows, cols = shape
    y = np.linspace(-1, 1, frames, dtype=np.float32)[:, None]
    x = np.linspace(-1, 1, cols, dtype=np.float32)[None, :]
    disc_x = 0.85 if laterality == "R" else -0.85
    bounds = layer_bounds(y, x, draws.tilt, draws.lift, laterality, label, signal, eye)  # [F, C, L+1]
    levels = np.array([VITREOUS] + [b for _, _, b in LAYERS] + [SCLERA], dtype=np.float32)
    z = (np.arange(rows, dtype=np.float32) + 0.5) / rows
    arc = -0.7 * np.sqrt(np.clip(np.abs(x - disc_x) / 1.7, 0, 1))                # vessel centre line (frames)
    half_width = max(0.06, 1.0 / max(frames - 1, 1))                            # at least one frame per column
    vessel = (np.abs(y - arc) < half_width) & (np.abs(x - disc_x) < 1.7)       # [F, C]
    out = np.empty(shape, dtype=np.uint8)
    noise = np.random.default_rng(draws.noise)
    for f in range(frames):
        speckle, floor = frame_noise(noise, (rows, cols))
        idx = np.zeros((rows, cols), dtype=np.intp)                            # [R, C] layer index:
        for k in range(bounds.shape[-1]):                                      # boundaries above each voxel
            idx += z[:, None] > bounds[f, :, k][None]
        img = levels[idx]
        depth_below = np.clip(z[:, None] - bounds[f, :, -2][None], 0, None)     # choroid fades
        img = img * np.where(idx >= len(LAYERS), np.exp(-depth_below * 8), 1.0)
        img = img * np.where(vessel[f][None, :] & (idx > 1), 0.5, 1.0)          # shadow below the RNFL
        img = _paint_lesions(img, eye.lesions, float(y[f, 0]), x, z, bounds[f]) + eye.offset
        img = draws.gain * img * speckle + floor                               # speckle, noise floor
        img = np.log1p(40 * np.clip(img, 0, None)) / np.log1p(40 * 1.6)
        out[f] = np.clip(img * 255, 0, 255).astype(np.uint8)
    return out


def _functional_group(spacing: tuple[float, float, float]) -> Dataset:
    pm = Dataset()
    pm.PixelSpacing = [f"{spacing[1]:.6g}", f"{spacing[2]:.6g}"]
    pm.SliceThickness = f"{spacing[0]:.6g}"
    fg = Dataset()
    fg.PixelMeasuresSequence = DicomSequence([pm])
    return fg


def tsv_spacing(spec: DeviceSpec) -> dict[str, str]:
    """manifest.tsv's pixel_spacing and slice_thickness strings, with the non-numeric values
    real exports carry ("Varies by frame" where spacing is per frame, "Not reported")."""
    f, r, c = spec.spacing
    return {"pixel_spacing": "Varies by frame" if spec.per_frame_spacing else f"{r:g}\\{c:g}",
            "slice_thickness": "Not reported" if spec.compress else f"{f:g}"}


def make_dataset(vol: np.ndarray, spec: DeviceSpec, spacing: tuple[float, float, float], *,
                 participant: str, laterality: str, sop_uid: str, study_uid: str, series_uid: str) -> Dataset:
    """An OPT (Ophthalmic Tomography) multi-frame dataset holding `vol`, uncompressed."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = OPT_SOP_CLASS
    meta.MediaStorageSOPInstanceUID = sop_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = OPT_SOP_CLASS, sop_uid
    ds.StudyInstanceUID, ds.SeriesInstanceUID = study_uid, series_uid
    ds.Modality = "OPT"
    ds.PatientID = participant
    ds.Manufacturer, ds.ManufacturerModelName = spec.manufacturer, spec.model
    ds.ImageLaterality = laterality
    ds.Laterality = laterality
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.NumberOfFrames = vol.shape[0]
    ds.Rows, ds.Columns = vol.shape[1], vol.shape[2]
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    if spec.per_frame_spacing:
        ds.PerFrameFunctionalGroupsSequence = DicomSequence([_functional_group(spacing) for _ in range(vol.shape[0])])
    else:
        ds.SharedFunctionalGroupsSequence = DicomSequence([_functional_group(spacing)])
    ds.PixelData = np.ascontiguousarray(vol).tobytes()
    return ds


def dicom_bytes(ds: Dataset, compress: str | None = None) -> bytes:
    if compress:
        ds = copy.deepcopy(ds)
        # keep the SOP Instance UID manifest.tsv lists (pydicom would draw a random one)
        ds.compress(compress, encoding_plugin="pylibjpeg", generate_instance_uid=False)
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


@dataclasses.dataclass
class SynthConfig:
    participants: int = 16
    scale: int = 8
    seed: int = 0
    signal: float = 0.0          # planted class cue strength (0: none)
    lesions: float | None = None  # the cohort's lesion cue (sample_eye); None: no lesions, no per-eye confounders
    lesion_size: float = 1.0     # every lesion's radii scaled by this (sample_eye)
    layers: float = 0.0          # the layers cue: INL thickening per label step in a macular patch (needs lesions set)
    bad_files: bool = True
    split_column: bool = True    # write recommended_split (False exercises the fallback)
    id_column: str = "participant_id"  # or person_id (release 3)
    unlabeled: int = 1           # participants with an empty study_group
    zipped: bool = False         # DICOMs in per-device ZIP archives (zip_layout) instead of plain files
    placeholders: bool = False   # tables and empty files only (no pixels): load tests of listing and manifest


META_STREAM = 0x1D5  # the participant table's own random stream (IDs, ages)


def _participants(cfg: SynthConfig) -> pd.DataFrame:
    from manifests.splits import stratified_split

    # IDs and ages come from a stream of their own, so they carry nothing of the row order that
    # sets the label (i mod 4) and the device, and the volumes (drawn from `seed`) stay as they were
    meta = np.random.default_rng([cfg.seed, META_STREAM])
    ids = [str(1001 + j) for j in meta.permutation(cfg.participants)]
    groups = [STUDY_GROUPS[i % 4] for i in range(cfg.participants)]
    for i in range(min(cfg.unlabeled, cfg.participants)):
        groups[-1 - i] = ""
    df = pd.DataFrame({
        "participant_id": ids,
        "clinical_site": [SITES[i % 3] for i in range(cfg.participants)],
        "study_group": groups,
        "age": [str(a) for a in meta.integers(40, 80, cfg.participants)],
        "study_visit_date": ["2023-05-01"] * cfg.participants,
    })
    labels = pd.Series([STUDY_GROUPS.index(g) if g else None for g in groups], dtype="Int8")
    df["recommended_split"] = stratified_split(pd.DataFrame({"participant_id": ids, "label": labels}), seed=cfg.seed)
    df["retinal_oct"] = "TRUE"
    if not cfg.split_column:
        df = df.drop(columns=["recommended_split"])
    return df.rename(columns={"participant_id": cfg.id_column})


@dataclasses.dataclass
class VolumeJob:
    """One volume, its random numbers drawn: rendering it and writing its DICOM can run in any
    process and in any order and give the same bytes."""
    shape: tuple[int, int, int]
    draws: VolumeDraws
    spec: DeviceSpec
    spacing: tuple[float, float, float]
    pid: str
    laterality: str
    label: int | None
    signal: float
    eye: Eye | None
    flip: bool
    uid: str
    study_uid: str

    def dataset(self) -> Dataset:
        vol = render_volume(self.shape, self.draws, self.laterality, self.label, self.signal, self.eye)
        if self.flip:  # Spectralis OCTA structural cubes come frame-reversed (AI-READI docs)
            vol = vol[::-1].copy()
        return make_dataset(vol, self.spec, self.spacing, participant=self.pid, laterality=self.laterality,
                            sop_uid=self.uid, study_uid=self.study_uid,
                            series_uid=generate_uid(entropy_srcs=[self.uid, "series"]))


def _write_job(job: VolumeJob, path: Path, compress: str | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(dicom_bytes(job.dataset(), compress))


WRITER_IMPORTS = ("pandas", "pydicom", "ingest.synth")  # what a writer needs: its process server preloads them


class _Writer:
    """Renders and writes volumes here (workers=0) or in a pool of processes, with at most two
    per worker in flight (a job is small: its volume's noise is drawn where it is rendered)."""

    def __init__(self, workers: int):
        self.pending: collections.deque = collections.deque()
        self.pool = None
        if workers > 0:
            ctx = procs.worker_context(preload=WRITER_IMPORTS)
            self.pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx)
        self.limit = 2 * workers

    def submit(self, job: VolumeJob, path: Path, compress: str | None) -> None:
        if self.pool is None:
            _write_job(job, path, compress)
            return
        self.pending.append(self.pool.submit(_write_job, job, path, compress))
        while len(self.pending) > self.limit:
            self.pending.popleft().result()

    def __enter__(self) -> "_Writer":
        return self

    def __exit__(self, kind, *_) -> None:
        if self.pool is None:
            return
        try:
            if kind is None:
                for f in self.pending:
                    f.result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


POOL_FROM = 64  # participants: below this a process pool's start-up costs more than it saves
MAX_WORKERS = 32  # a large host (a TPU VM's 240 vCPUs) would otherwise start a process per core


def default_workers(cfg: SynthConfig) -> int:
    if cfg.placeholders or cfg.participants < POOL_FROM:
        return 0
    return min(MAX_WORKERS, len(os.sched_getaffinity(0)))


def generate(out: str | Path, cfg: SynthConfig = SynthConfig(), workers: int | None = None,
             progress: bool = False) -> dict:
    """Write the tree under `out` (replacing it). Returns counts for the summary.

    The random numbers are drawn in one stream, in participant order; with `workers` > 0
    (default: the cores, for cohorts of POOL_FROM participants or more) the volumes are rendered
    and written by that many processes. The bytes do not depend on `workers` (tested)."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    (out / "retinal_oct").mkdir(parents=True)
    rng = np.random.default_rng(cfg.seed)
    people = _participants(cfg)
    people.to_csv(out / "participants.tsv", sep="\t", index=False)
    rows, counts = [], {"good": 0, "bad": 0, "missing": 0, "octa": 0}
    lesion_rows: list[dict] = []
    device_names = list(DEVICES)
    study_uid = generate_uid(entropy_srcs=[f"study-{cfg.seed}"])

    def add_file(pid: str, spec: DeviceSpec, lat: str, name: str, data: bytes | None, shape, sop_uid: str,
                 imaging: str = "OCT") -> str:
        rel = f"retinal_oct/structural_oct/{spec.name}/{pid}/{name}"
        if data is not None:
            path = out / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        rows.append({
            "participant_id": pid, "manufacturer": spec.manufacturer, "manufacturers_model_name": spec.model,
            "anatomic_region": "macula", "imaging": imaging, "laterality": lat.lower(),
            "height": shape[1], "width": shape[2], "number_of_frames": shape[0],
            **tsv_spacing(spec), "sop_instance_uid": sop_uid,
            "filepath": "/" + rel, "reference_instance_uid": "", "reference_filepath": "",
        })
        return rel

    def volume_job(pid, spec, lat, label, imaging="OCT", flip=False, vol_rng=None):
        """The volume's job (None with placeholders), its shape and SOP Instance UID; draws its
        random numbers now, in the stream's order."""
        shape = scaled_shape(spec.name, cfg.scale)
        f, r, c = spec.shape
        spacing = tuple(s * n / m for s, n, m in zip(spec.spacing, (f, r, c), shape))
        uid = generate_uid(entropy_srcs=[f"{cfg.seed}-{pid}-{spec.name}-{lat}-{imaging}"])
        if cfg.placeholders:
            return None, shape, uid
        r = vol_rng or rng
        eye = sample_eye(label, r, cfg.lesions, cfg.lesion_size, cfg.layers) if cfg.lesions is not None else None
        job = VolumeJob(shape, draw_volume(shape, r), spec, spacing, pid, lat, label, cfg.signal, eye, flip, uid,
                        study_uid)
        return job, shape, uid

    def volume_dataset(pid, spec, lat, label):
        job, shape, uid = volume_job(pid, spec, lat, label)
        return job.dataset(), shape, uid

    with _Writer(default_workers(cfg) if workers is None else workers) as writer:
        for i, row in tqdm(people.iterrows(), total=len(people), desc="cohort", unit="participant",
                           disable=not progress, dynamic_ncols=True):
            pid = row[cfg.id_column]
            g = row["study_group"]
            label = STUDY_GROUPS.index(g) if g else None
            # a Latin square: over 16 participants each (device, label) pair occurs once, so the
            # device says nothing about the label (a probe must not score by recognising scanners)
            spec = DEVICES[device_names[(i + i // 4) % len(device_names)]]
            volumes = [("R", "OCT", None), ("L", "OCT", None)]
            if spec.name == "heidelberg_spectralis":
                volumes.append(("R", "OCTA", np.random.default_rng(cfg.seed * 1000 + i)))
            for lat, imaging, vol_rng in volumes:
                octa = imaging == "OCTA"
                job, shape, uid = volume_job(pid, spec, lat, label, imaging, flip=octa, vol_rng=vol_rng)
                name = f"{pid}_{spec.short}_mac_{imaging.lower()}_{lat.lower()}_{uid}.dcm"
                rel = add_file(pid, spec, lat, name, b"" if job is None else None, shape, uid, imaging)
                if job is not None:
                    writer.submit(job, out / rel, None if octa else spec.compress)
                    lesion_rows += [{"participant_id": pid, "filepath": "/" + rel, **les} for les in
                                    lesion_table(job.draws, lat, label, cfg.signal, job.eye)]
                counts["good"] += 1
                counts["octa"] += octa

    if cfg.bad_files:
        _add_bad_files(people[cfg.id_column].iloc[0], add_file, volume_dataset, counts)
    pd.DataFrame(rows).to_csv(out / "retinal_oct" / "manifest.tsv", sep="\t", index=False)
    if cfg.lesions is not None:  # the answer key of the lesions cue, per volume (not part of AI-READI)
        pd.DataFrame(lesion_rows, columns=["participant_id", "filepath", *LESION_COLUMNS]).to_csv(
            out / LESION_TABLE, sep="\t", index=False)
        counts["lesions"] = len(lesion_rows)
    if cfg.zipped:
        counts["archives"] = zip_layout(out)
    return counts


ZIP_DATE = (2023, 5, 1, 12, 0, 0)  # fixed member timestamps: the same tree gives the same archives


def zip_layout(root: str | Path, parts: int = 2) -> int:
    """Turn a plain tree into the zipped layout researchers receive: each device folder's
    participant folders go into `parts` archives in that folder (part1.zip, ...; members
    named <participant>/<file>), the odd-numbered deflated and the even ones stored, so both
    methods are exercised. TSV files stay plain. Returns the number of archives written."""
    oct_root = Path(root) / "retinal_oct" / "structural_oct"
    n = 0
    for dev in sorted(p for p in oct_root.iterdir() if p.is_dir()):
        people = sorted(p for p in dev.iterdir() if p.is_dir())
        for k in range(parts):
            chunk = people[k * len(people) // parts:(k + 1) * len(people) // parts]
            if not chunk:
                continue
            method = zipfile.ZIP_DEFLATED if k % 2 == 0 else zipfile.ZIP_STORED
            with zipfile.ZipFile(dev / f"part{k + 1}.zip", "w") as zf:
                for person in chunk:
                    for f in sorted(person.iterdir()):
                        info = zipfile.ZipInfo(f"{person.name}/{f.name}", date_time=ZIP_DATE)
                        info.compress_type = method
                        zf.writestr(info, f.read_bytes(), compresslevel=1 if method == zipfile.ZIP_DEFLATED else None)
                    shutil.rmtree(person)
            n += 1
    return n


def _add_bad_files(pid: str, add_file, volume_dataset, counts: dict) -> None:
    """The failure modes real buckets show, each listed in manifest.tsv."""
    spec = DEVICES["topcon_triton"]
    ds, shape, uid = volume_dataset(pid, spec, "R", 0)
    good = dicom_bytes(ds)
    add_file(pid, spec, "R", f"{pid}_triton_bad_truncated.dcm", good[: int(len(good) * 0.6)], shape, uid + ".1")
    nopix = copy.deepcopy(ds)
    del nopix.PixelData
    add_file(pid, spec, "R", f"{pid}_triton_bad_nopixels.dcm", dicom_bytes(nopix), shape, uid + ".2")
    mismatch = copy.deepcopy(ds)
    mismatch.NumberOfFrames = shape[0] + 3
    add_file(pid, spec, "R", f"{pid}_triton_bad_frames.dcm", dicom_bytes(mismatch), shape, uid + ".3")
    add_file(pid, spec, "R", f"{pid}_triton_bad_notdicom.dcm", b"this is a text file, not DICOM\n" * 20,
             shape, uid + ".4")
    add_file(pid, spec, "R", f"{pid}_triton_bad_missing.dcm", None, shape, uid + ".5")
    counts["bad"] += 4
    counts["missing"] += 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ingest.synth", description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--participants", type=int, default=SynthConfig.participants)
    ap.add_argument("--scale", type=int, default=SynthConfig.scale)
    ap.add_argument("--seed", type=int, default=SynthConfig.seed)
    ap.add_argument("--signal", type=float, default=SynthConfig.signal)
    ap.add_argument("--lesions", type=float, default=None,
                    help="the learning-check cohort's cue: macular lesions whose number grows with the label "
                         "(1: the cohort's rates, 0: every class like healthy), with per-eye thickness and brightness")
    ap.add_argument("--lesion-size", type=float, default=SynthConfig.lesion_size,
                    help="with --lesions: every lesion's radii scaled by this")
    ap.add_argument("--layers", type=float, default=SynthConfig.layers,
                    help="with --lesions: the layers cue, a macular patch of inner nuclear layer thickened by this x "
                         "the label (relative, at its peak), the outer nuclear layer thinned as much")
    ap.add_argument("--unlabeled", type=int, default=SynthConfig.unlabeled, help="participants without a study group")
    ap.add_argument("--no-bad-files", action="store_true")
    ap.add_argument("--no-split-column", action="store_true")
    ap.add_argument("--person-id", action="store_true", help="name the ID column person_id (release 3)")
    ap.add_argument("--zipped", action="store_true",
                    help="DICOMs in per-device ZIP archives (<device>/part1.zip, members <participant>/<file>)")
    a = ap.parse_args(argv)
    if a.scale < 1 or a.participants < 1:
        raise cli.UsageError("--scale and --participants must be >= 1")
    cfg = SynthConfig(participants=a.participants, scale=a.scale, seed=a.seed, signal=a.signal, lesions=a.lesions,
                      lesion_size=a.lesion_size, layers=a.layers, unlabeled=a.unlabeled,
                      bad_files=not a.no_bad_files, split_column=not a.no_split_column,
                      id_column="person_id" if a.person_id else "participant_id", zipped=a.zipped)
    counts = generate(a.out, cfg, progress=True)
    n_bytes = sum(p.stat().st_size for p in Path(a.out).rglob("*") if p.is_file())
    layout = f"; in {counts['archives']} ZIP archives" if a.zipped else ""
    print(f"synth: wrote {a.out}: {counts['good']} good volumes ({counts['octa']} Spectralis OCTA, frame-reversed), "
          f"{counts['bad']} bad files, {counts['missing']} listed but missing{layout}; {n_bytes / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    cli.run(main)
