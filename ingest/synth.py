"""A synthetic AI-READI-shaped OCT dataset for the demo and the tests.

The retinal phantom's volumes (ingest/phantom.py) written as OPT multi-frame DICOM at each
scanner's native aspect ratio (scaled down by `scale`), with participants.tsv, manifest.tsv and,
for the learning-check cohorts, the lesions' answer key. Includes a JPEG 2000 device,
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

# LESION_EDGE is not used here: check/token_probe.py reads it as synth.LESION_EDGE
from ingest.phantom import (LESION_COLUMNS, LESION_EDGE, Eye, VolumeDraws, draw_volume, lesion_table,  # noqa: F401
                            render_volume, sample_eye)
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
LESION_TABLE = "lesions.tsv"  # at the cohort's root: where every lesion sits (phantom.lesion_table)


def scaled_shape(device: str, scale: int) -> tuple[int, int, int]:
    f, r, c = DEVICES[device].shape
    return max(8, round(f / scale)), max(16, round(r / scale)), max(16, round(c / scale))


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
