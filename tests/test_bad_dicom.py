"""More bad DICOM inputs through the real worker (a first part of the faults issue)."""
import copy
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cache import build, store
from cache.worker import process_row
from ingest import phantom, synth
from octfm import config
from conftest import REPO

# hand-made files carry no frame traces and no Protocol Name: their scan pattern is unknown, kept here
CFG = config.to_dict(config.from_dict(build.CacheConfig, {"preprocess": {"target_shape": [8, 32, 32],
                                                                           "max_voxels": 10_000_000},
                                                          "select": {"scan_pattern": ["raster", "unknown"]}}))
SPEC = synth.DEVICES["topcon_triton"]


def dataset(vol=None, **changes):
    vol = phantom.make_volume((8, 40, 32), np.random.default_rng(0), "R") if vol is None else vol
    ds = synth.make_dataset(vol, SPEC, (0.05, 0.003, 0.02), participant="1", laterality="R", sop_uid="1.2.3.4",
                            study_uid="1.2.3", series_uid="1.2.3.5")
    for k, v in changes.items():
        setattr(ds, k, v)
    return ds


def run(tmp_path, data: bytes, name="x.dcm"):
    path = tmp_path / name
    path.write_bytes(data)
    row = {"relpath": f"retinal_oct/structural_oct/topcon_triton/1/{name}", "source": str(path), "cache_key": "k",
           "device": "topcon_triton"}
    return process_row(row, CFG, str(tmp_path / "cache"), "t")


def test_zero_bytes(tmp_path):
    out = run(tmp_path, b"")
    assert out["status"] == "failed" and out["error"].startswith("not DICOM: empty file")


@pytest.mark.parametrize("cut", [0.05, 0.3, 0.9, 0.999])
def test_truncated_at_several_offsets(tmp_path, cut):
    data = synth.dicom_bytes(dataset())
    out = run(tmp_path, data[: int(len(data) * cut)])
    assert out["status"] == "failed"
    assert out["error"].split(":")[0] in ("truncated pixel data", "truncated or corrupt header", "not DICOM",
                                          "no PixelData"), out["error"]


def test_rgb_is_refused(tmp_path):
    vol = np.zeros((2, 8, 8, 3), np.uint8)
    ds = dataset(phantom.make_volume((2, 8, 8), np.random.default_rng(1)))
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "RGB", 0
    ds.PixelData = vol.tobytes()
    out = run(tmp_path, synth.dicom_bytes(ds))
    assert out["status"] == "failed" and out["error"].startswith("not monochrome")


def test_absurd_dimensions_are_refused_before_decoding(tmp_path):
    ds = dataset(NumberOfFrames=100000, Rows=4000, Columns=4000)
    out = run(tmp_path, synth.dicom_bytes(ds))
    assert out["status"] == "failed" and out["error"].startswith("dimensions too large")
    assert "preprocess.max_voxels" in out["error"]


def test_sixteen_bit_is_cached_like_eight_bit(tmp_path):
    vol8 = phantom.make_volume((8, 40, 32), np.random.default_rng(2), "R")
    ds16 = dataset(vol8.astype(np.uint16) * 16)
    ds16.BitsAllocated, ds16.BitsStored, ds16.HighBit = 16, 12, 11
    ds16.PixelData = (vol8.astype(np.uint16) * 16).tobytes()
    a = run(tmp_path, synth.dicom_bytes(dataset(vol8)), "a.dcm")
    b = run(tmp_path, synth.dicom_bytes(ds16), "b.dcm")
    assert a["status"] == b["status"] == "ok", (a.get("error"), b.get("error"))
    va, vb = (store.read_volume(str(tmp_path / "cache"), r["volume"]) for r in (a, b))
    assert b["lo"] == pytest.approx(16 * a["lo"]) and b["hi"] == pytest.approx(16 * a["hi"])
    assert np.abs(va.astype(int) - vb.astype(int)).max() <= 1


def test_missing_spacing_is_cached_with_null_spacing(tmp_path):
    ds = dataset()
    del ds.SharedFunctionalGroupsSequence
    out = run(tmp_path, synth.dicom_bytes(ds))
    assert out["status"] == "ok" and out["spacing_mm"] is None and out["native_spacing_mm"] is None


def test_wrong_modality_photo_is_refused(tmp_path):
    ds = copy.deepcopy(dataset())
    ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.77.1.5.1"  # ophthalmic photo
    ds.Modality = "OP"
    out = run(tmp_path, synth.dicom_bytes(ds))
    assert out["status"] == "failed" and out["error"].startswith("wrong SOP class")


def _small_tree(tmp_path, participants=4):
    root = tmp_path / "ds"
    synth.generate(root, synth.SynthConfig(participants=participants, scale=16, seed=5, bad_files=False))
    return root


def test_duplicate_sop_instance_uid_keeps_the_first_path(tmp_path):
    import pandas as pd

    from manifests import build as manifest_build

    root = _small_tree(tmp_path)
    tsv = root / "retinal_oct" / "manifest.tsv"
    df = pd.read_csv(tsv, sep="\t", dtype=str, keep_default_na=False)
    first = root / df.filepath[0].lstrip("/")
    # a listed copy under another name (manifest.tsv reveals it) and an unlisted one (only the header does)
    listed, unlisted = first.with_name("zz_listed_copy.dcm"), first.with_name("zz_unlisted_copy.dcm")
    shutil.copy(first, listed)
    shutil.copy(first, unlisted)
    extra = df.iloc[[0]].copy()
    extra["filepath"] = str(listed.relative_to(root))
    pd.concat([df, extra]).to_csv(tsv, sep="\t", index=False)

    rows = {r["relpath"]: r for r in manifest_build.build_sources(str(root))[0]}
    keep = df.filepath[0].lstrip("/")
    assert rows[keep]["manifest_error"] is None
    assert rows[str(listed.relative_to(root))]["manifest_error"] == \
        f"duplicate SOP instance UID: {df.sop_instance_uid[0]} is also {keep}"
    assert rows[str(unlisted.relative_to(root))].get("sop_instance_uid") is None  # not known before the header is read

    cfg = config.from_dict(build.CacheConfig, {"preprocess": {"target_shape": [8, 32, 32]}})
    for attempt in range(2):  # the verdict holds on a re-run that reuses the volumes
        out = {r["relpath"]: r for r in build.build(str(root), str(tmp_path / "cache"), cfg, progress=False)}
        assert out[keep]["status"] == "ok"
        for copy_path in (listed, unlisted):
            row = out[str(copy_path.relative_to(root))]
            assert row["status"] == "failed" and row["volume"] is None, (attempt, row["error"])
            assert row["error"] == f"duplicate SOP instance UID: {df.sop_instance_uid[0]} is also {keep}"
        radial = sum(r["scan_pattern"] == "radial" for r in out.values())
        assert radial and sum(r["status"] == "skipped" for r in out.values()) == radial
        assert sum(r["status"] == "ok" for r in out.values()) == len(df) - radial


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_unreadable_file_fails_its_row_when_run_unprivileged(tmp_path):
    """Root ignores file modes, so the build runs without the capabilities that let it
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), reading as an unprivileged user would. Switching
    to uid 65534 instead would lose the interpreter, which lives under /root here."""
    import pandas as pd

    root = _small_tree(tmp_path)
    tsv = pd.read_csv(root / "retinal_oct" / "manifest.tsv", sep="\t", dtype=str)
    locked_rel = tsv.filepath[1].lstrip("/")
    (root / locked_rel).chmod(0o000)
    cache = tmp_path / "cache"
    r = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-m",
                        "cache.build", "--source", str(root), "--cache", str(cache), "--no-progress", "--strict",
                        "preprocess.target_shape=[8,32,32]"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    df = pd.read_parquet(cache / "manifest.parquet").set_index("relpath")
    bad = df.loc[locked_rel]
    assert bad.status == "failed" and bad.error.startswith("unreadable: permission denied"), bad.error
    rest = df.drop(index=locked_rel)
    assert (rest.status == "ok").sum() == (rest.scan_pattern == "raster").sum() > 0
    assert (rest[rest.scan_pattern != "raster"].status == "skipped").all()  # the radial scans: never failed
    assert "unreadable" in r.stdout  # the summary names the reason
