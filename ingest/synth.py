"""A synthetic AI-READI-shaped OCT dataset for the demo and the tests.

The retinal phantom's volumes (ingest/phantom.py) written as OPT multi-frame DICOM the way AI-READI's
converters write the release's scan protocols (manifests/protocols.py; docs/data.md, "Scan protocols"):
their shapes scaled down by `scale`, the converters' file names and Protocol Names (Zeiss's on Cirrus),
spacing in the shared functional groups (per frame on the radial scan), Cirrus's Slice Thickness
overwritten with the column spacing, each frame's trace on the localizer, and the Spectralis OCTA cube
written with its frames reversed and no traces, as AI-READI documents it. With participants.tsv,
manifest.tsv and, for the learning-check cohorts, the lesions' answer key. Each participant has their
device's main raster protocol for both eyes; Spectralis participants also a radial disc scan (a scan
that is no volume); `protocols="all"` adds every other protocol of the device; `others` each scan's
flow cube and infrared photo. Includes a JPEG 2000 device, the bad files real buckets contain, and the
layouts users hold: as released, zipped per device, or repacked as one research group packs its bucket.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import dataclasses
import os
import shutil
import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
from pydicom.dataset import Dataset
from pydicom.uid import generate_uid
from tqdm import tqdm

# LESION_EDGE is not used here: check/token_probe.py reads it as synth.LESION_EDGE
from ingest.phantom import (LESION_COLUMNS, LESION_EDGE, Eye, VolumeDraws, draw_volume, lesion_table,  # noqa: F401
                            render_volume, sample_eye)
# the release's files as AI-READI's converters write them; the tests and benchmarks reach them through this module
from ingest.release_files import (DEVICES, OPT_SOP_CLASS, OTHER_MODALITIES, DeviceSpec, compression,  # noqa: F401
                                  dicom_bytes, has_traces, header_spacing, localizer_traces, make_dataset,
                                  per_frame_spacing, tsv_spacing, write_other_modalities)
from manifests.aireadi import SITES, STUDY_GROUPS
from manifests.protocols import PROTOCOLS, RADIAL, Protocol
from octfm import cli, procs

LESION_TABLE = "lesions.tsv"  # at the cohort's root: where every lesion sits (phantom.lesion_table)
# each device's main raster protocol: every participant has it, both eyes (its shape is the device's above)
MAIN_PROTOCOL = {
    "heidelberg_spectralis": "spectralis ppol mac hr oct", "topcon_maestro2": "maestro2 3d macula oct",
    "topcon_triton": "triton 3d radial oct", "zeiss_cirrus": "cirrus mac oct",
}
RADIAL_PROTOCOL = "spectralis onh rc hr oct"  # every Spectralis participant's right eye: skipped by `make cache`
LAYOUTS = ("plain", "zipped", "repack")
# protocols whose field AI-READI gives in degrees ("Macula, 20 x 20": Heidelberg's 20 x 20 degree scan), so
# no published mm: a square scan, its frames spanning what its columns span at the device's column spacing
SQUARE_IN_DEGREES = {"spectralis mac 20x20 hs octa"}


def scaled_shape(device: str, scale: int, protocol: str | None = None) -> tuple[int, int, int]:
    f, r, c = PROTOCOLS[protocol].shapes[0] if protocol else DEVICES[device].shape
    return max(8, round(f / scale)), max(16, round(r / scale)), max(16, round(c / scale))


def native_spacing(spec: DeviceSpec, protocol: Protocol) -> tuple[float, float, float]:
    """(frame, row, col) spacing at native size: the published field over the frames and columns
    where there is one, else the device's (a square scan's frames: its columns' extent)."""
    f, _, c = protocol.shapes[0]
    across, along = protocol.field_mm
    col = along / c if along else spec.spacing[2]
    if not across and protocol.name in SQUARE_IN_DEGREES:
        across = col * c
    return (across / f if across else spec.spacing[0], spec.spacing[1], col)


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
    layout: str = "plain"        # plain | zipped | repack (repack_layout: one group's bucket); zipped=True: zipped
    protocols: str = "main"      # main: each device's main raster protocol (+ the Spectralis radial scan); all: every one
    reversed: tuple[str, ...] = ()  # protocols whose frames are written bottom to top (their traces say so)
    placeholders: bool = False   # tables and empty files only (no pixels): load tests of listing and manifest
    # each OCT scan's sibling files as AI-READI releases them: a flow cube (retinal_octa/flow_cube/) and an infrared
    # localizer photo (retinal_photography/ir/), named for the same protocol; in a repacked bucket's ZIP beside the OCT
    others: bool = False

    def __post_init__(self):
        if self.zipped:
            self.layout = "zipped"
        if self.layout not in LAYOUTS or self.protocols not in ("main", "all"):
            raise ValueError(f"layout {self.layout!r} not in {LAYOUTS}, or protocols {self.protocols!r} not main/all")


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
    reverse: bool             # frames written bottom to top, the traces saying so
    uid: str
    study_uid: str
    protocol: Protocol

    def dataset(self) -> Dataset:
        vol = render_volume(self.shape, self.draws, self.laterality, self.label, self.signal, self.eye)
        reverse = self.reverse or self.protocol.frames_reversed
        if reverse:
            vol = vol[::-1].copy()
        traces = (localizer_traces(self.protocol, self.shape[0], self.shape[2], self.spacing, reverse)
                  if has_traces(self.protocol) else None)
        return make_dataset(vol, self.spec, header_spacing(self.spec, self.spacing), participant=self.pid,
                            laterality=self.laterality, sop_uid=self.uid, study_uid=self.study_uid,
                            series_uid=generate_uid(entropy_srcs=[self.uid, "series"]),
                            protocol_name=self.protocol.header_name, traces=traces,
                            per_frame=per_frame_spacing(self.protocol))


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


class _Tree:
    """The tree being written: manifest.tsv's rows, the lesions' answer key and the counts, and the one
    random stream the volumes are drawn from, in participant order."""

    def __init__(self, out: Path, cfg: SynthConfig):
        self.out, self.cfg = out, cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.rows: list[dict] = []
        self.lesion_rows: list[dict] = []
        self.counts = {"good": 0, "bad": 0, "missing": 0, "radial": 0, "others": 0, "protocols": collections.Counter()}
        self.study_uid = generate_uid(entropy_srcs=[f"study-{cfg.seed}"])

    def add_file(self, pid: str, spec: DeviceSpec, lat: str, name: str, data: bytes | None, shape, sop_uid: str,
                 protocol: Protocol, spacing) -> str:
        """manifest.tsv's row for a file (written here when `data` is given; None: listed but missing)."""
        rel = f"retinal_oct/structural_oct/{spec.name}/{pid}/{name}"
        if data is not None:
            path = self.out / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        self.rows.append({
            "participant_id": pid, "manufacturer": spec.manufacturer, "manufacturers_model_name": spec.model,
            "anatomic_region": protocol.region, "imaging": "OCT", "laterality": lat.upper(),
            "height": shape[1], "width": shape[2], "number_of_frames": shape[0],
            **tsv_spacing(spec, protocol, spacing), "sop_instance_uid": sop_uid,
            "filepath": "/" + rel, "reference_instance_uid": "", "reference_filepath": "",
        })
        return rel

    def volume_job(self, pid, spec, lat, label, protocol: Protocol, vol_rng=None, uid_tag="OCT"):
        """The volume's job (None with placeholders), its shape, SOP Instance UID and spacing; draws its
        random numbers now, in the stream's order."""
        cfg = self.cfg
        shape = scaled_shape(spec.name, cfg.scale, protocol.name)
        spacing = tuple(s * n / m for s, n, m in zip(native_spacing(spec, protocol), protocol.shapes[0], shape))
        uid = generate_uid(entropy_srcs=[f"{cfg.seed}-{pid}-{spec.name}-{lat}-{uid_tag}"])
        if cfg.placeholders:
            return None, shape, uid, spacing
        r = vol_rng or self.rng
        eye = sample_eye(label, r, cfg.lesions, cfg.lesion_size, cfg.layers) if cfg.lesions is not None else None
        job = VolumeJob(shape, draw_volume(shape, r), spec, spacing, pid, lat, label, cfg.signal, eye,
                        protocol.name in cfg.reversed, uid, self.study_uid, protocol)
        return job, shape, uid, spacing

    def volume_dataset(self, pid, spec, lat, label):
        job, shape, uid, spacing = self.volume_job(pid, spec, lat, label, PROTOCOLS[MAIN_PROTOCOL[spec.name]])
        return job.dataset(), shape, uid, spacing

    def participant(self, i: int, pid: str, label: int | None, writer: "_Writer") -> None:
        """Every scan of participant i. A Latin square sets the scanner: over 16 participants each
        (scanner, label) pair occurs once, so the scanner says nothing about the label (a probe must
        not score by recognising scanners)."""
        names = list(DEVICES)
        spec = DEVICES[names[(i + i // 4) % len(names)]]
        for protocol, lat, vol_rng, uid_tag in _scans(self.cfg, spec, i):
            job, shape, uid, spacing = self.volume_job(pid, spec, lat, label, protocol, vol_rng, uid_tag)
            rel = self.add_file(pid, spec, lat, protocol.file_name(pid, lat, uid), b"" if job is None else None, shape,
                                uid, protocol, spacing)
            if job is not None:
                if self.cfg.others:
                    self.counts["others"] += write_other_modalities(self.out, spec, protocol, pid, lat, uid)
                writer.submit(job, self.out / rel, compression(spec, protocol, shape))
                if protocol.pattern != RADIAL:  # the lesions' answer key covers the volumes
                    self.lesion_rows += [{"participant_id": pid, "filepath": "/" + rel, **les} for les in
                                         lesion_table(job.draws, lat, label, self.cfg.signal, job.eye)]
            self.counts["good"] += 1
            self.counts["radial"] += protocol.pattern == RADIAL
            self.counts["protocols"][protocol.name] += 1


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
    people = _participants(cfg)
    people.to_csv(out / "participants.tsv", sep="\t", index=False)
    tree = _Tree(out, cfg)
    with _Writer(default_workers(cfg) if workers is None else workers) as writer:
        for i, row in tqdm(people.iterrows(), total=len(people), desc="cohort", unit="participant",
                           disable=not progress, dynamic_ncols=True):
            g = row["study_group"]
            tree.participant(i, row[cfg.id_column], STUDY_GROUPS.index(g) if g else None, writer)
    if cfg.bad_files:
        _add_bad_files(people[cfg.id_column].iloc[0], tree.add_file, tree.volume_dataset, tree.counts)
    pd.DataFrame(tree.rows).to_csv(out / "retinal_oct" / "manifest.tsv", sep="\t", index=False)
    counts = tree.counts
    if cfg.lesions is not None:  # the answer key of the lesions cue, per volume (not part of AI-READI)
        pd.DataFrame(tree.lesion_rows, columns=["participant_id", "filepath", *LESION_COLUMNS]).to_csv(
            out / LESION_TABLE, sep="\t", index=False)
        counts["lesions"] = len(tree.lesion_rows)
    if cfg.layout == "zipped":
        counts["archives"] = zip_layout(out)
    elif cfg.layout == "repack":
        counts["archives"] = repack_layout(out)
    return counts


def _scans(cfg: SynthConfig, spec: DeviceSpec, i: int):
    """(protocol, eye, random stream, UID tag) of each scan of participant i: the main protocol's
    eyes from the cohort's stream (so its volumes stay as they were), every other scan from a
    stream of its own."""
    main = PROTOCOLS[MAIN_PROTOCOL[spec.name]]
    yield main, "R", None, "OCT"
    yield main, "L", None, "OCT"
    if spec.name == "heidelberg_spectralis":
        yield PROTOCOLS[RADIAL_PROTOCOL], "R", np.random.default_rng(cfg.seed * 1000 + i), "OCTA"
    if cfg.protocols == "all":
        others = [p for p in PROTOCOLS.values() if p.device == spec.name and p.name not in (main.name, RADIAL_PROTOCOL)]
        for k, protocol in enumerate(others):
            for e, lat in enumerate(("R", "L")):
                yield protocol, lat, np.random.default_rng([cfg.seed, i, k, e, 0x9A7]), protocol.name


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


def repack_layout(root: str | Path) -> int:
    """Turn a plain tree into the layout one research group keeps its bucket in: manifest.tsv beside
    participants.tsv at the root, and one ZIP per device at <root>/<device>/<device>.zip whose members
    are <participant>/<file> (the manifest's filepath keeps the release's form, so no row is at its
    path: `make manifest` finds them by file name). One device's members are written `./<participant>/...`,
    as some archivers name them. A device's other modalities (flow cubes, photographs: `others`) go into
    its archive beside the OCT files, as a group that zipped a scanner's whole export would hold them.
    Returns the number of archives written."""
    root = Path(root)
    oct_root = root / "retinal_oct" / "structural_oct"
    others = [root / folder for folder, _, _ in OTHER_MODALITIES.values()]
    n = 0
    for k, dev in enumerate(sorted(p for p in oct_root.iterdir() if p.is_dir())):
        (root / dev.name).mkdir()
        prefix = "./" if k == 0 else ""
        files = [*dev.rglob("*.dcm"), *(f for o in others for f in (o / dev.name).rglob("*.dcm"))]
        with zipfile.ZipFile(root / dev.name / f"{dev.name}.zip", "w") as zf:
            for f in sorted(files, key=lambda f: (f.parent.name, f.name)):
                info = zipfile.ZipInfo(f"{prefix}{f.parent.name}/{f.name}", date_time=ZIP_DATE)
                info.compress_type = zipfile.ZIP_STORED
                zf.writestr(info, f.read_bytes())
        n += 1
    (root / "retinal_oct" / "manifest.tsv").rename(root / "manifest.tsv")
    shutil.rmtree(root / "retinal_oct")
    for folder in {o.relative_to(root).parts[0] for o in others}:
        shutil.rmtree(root / folder, ignore_errors=True)
    return n


def _add_bad_files(pid: str, add_file, volume_dataset, counts: dict) -> None:
    """The failure modes real buckets show, each listed in manifest.tsv."""
    spec = DEVICES["topcon_triton"]
    protocol = PROTOCOLS[MAIN_PROTOCOL[spec.name]]
    ds, shape, uid, spacing = volume_dataset(pid, spec, "R", 0)
    good = dicom_bytes(ds)

    def bad(kind: str, data: bytes | None, k: int) -> None:
        add_file(pid, spec, "R", f"{pid}_triton_bad_{kind}.dcm", data, shape, f"{uid}.{k}", protocol, spacing)

    bad("truncated", good[: int(len(good) * 0.6)], 1)
    nopix = copy.deepcopy(ds)
    del nopix.PixelData
    bad("nopixels", dicom_bytes(nopix), 2)
    mismatch = copy.deepcopy(ds)
    mismatch.NumberOfFrames = shape[0] + 3
    bad("frames", dicom_bytes(mismatch), 3)
    bad("notdicom", b"this is a text file, not DICOM\n" * 20, 4)
    bad("missing", None, 5)
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
    ap.add_argument("--zipped", action="store_true", help="--layout zipped")
    ap.add_argument("--layout", choices=LAYOUTS, default="plain",
                    help="plain: as released; zipped: per-device ZIP archives in the device folders (<device>/part1.zip, "
                         "members <participant>/<file>); repack: tables at the root, <root>/<device>/<device>.zip")
    ap.add_argument("--other-modalities", action="store_true",
                    help="each OCT scan's flow cube and infrared photo beside it, as the release holds them "
                         "(in a repacked bucket, in the device's ZIP): `make manifest` ignores and counts them")
    ap.add_argument("--protocols", choices=("main", "all"), default="main",
                    help="main: each device's main raster protocol, both eyes, and a radial disc scan per Spectralis "
                         "participant; all: every protocol of the release on each participant's device")
    a = ap.parse_args(argv)
    if a.scale < 1 or a.participants < 1:
        raise cli.UsageError("--scale and --participants must be >= 1")
    cfg = SynthConfig(participants=a.participants, scale=a.scale, seed=a.seed, signal=a.signal, lesions=a.lesions,
                      lesion_size=a.lesion_size, layers=a.layers, unlabeled=a.unlabeled,
                      bad_files=not a.no_bad_files, split_column=not a.no_split_column,
                      id_column="person_id" if a.person_id else "participant_id",
                      layout="zipped" if a.zipped else a.layout, protocols=a.protocols, others=a.other_modalities)
    counts = generate(a.out, cfg, progress=True)
    n_bytes = sum(p.stat().st_size for p in Path(a.out).rglob("*") if p.is_file())
    layout = f"; {cfg.layout} layout, {counts['archives']} ZIP archives" if cfg.layout != "plain" else ""
    print(f"synth: wrote {a.out}: {counts['good']} good files in {len(counts['protocols'])} protocols "
          f"({counts['radial']} radial scans), {counts['bad']} bad files, {counts['missing']} listed but missing, "
          f"{counts['others']} of other modalities"
          f"{layout}; {n_bytes / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    cli.run(main)
