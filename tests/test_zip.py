"""Zipped sources: DICOMs read in place from per-device ZIP archives (local and gs://),
CRC-32 and corrupt-archive failures, `make expand`, bounded memory."""
import hashlib
import json
import re
import shutil
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pandas as pd
import pytest
from conftest import REPO, SMALL, gcs_bucket, run_cli, run_here

from cache import store
from ingest import synth
from manifests import build, schema
from octfm import fsio

OCT = "retinal_oct/structural_oct"
# what legitimately differs between the zipped and the plain form of one tree
SOURCE_ONLY = ["source", "source_version", "cache_key", "scan_key"]  # scan_key holds cache_key


@pytest.fixture(scope="module")
def zipped_tree(synth_tree, tmp_path_factory):
    """synth_tree's exact files, moved into per-device archives (part1 deflated, part2 stored)."""
    root = tmp_path_factory.mktemp("zipped") / "dataset"
    shutil.copytree(synth_tree, root)
    assert synth.zip_layout(root) == 8
    return root


def frame(rows_or_df, drop=()) -> pd.DataFrame:
    df = pd.DataFrame(rows_or_df) if isinstance(rows_or_df, list) else rows_or_df
    return df.drop(columns=list(drop)).sort_values("relpath").reset_index(drop=True)


def member_data_offset(archive, name: str) -> int:
    """Where a member's (stored) bytes start: after its local header, name and extra field."""
    with zipfile.ZipFile(archive) as zf:
        info = zf.getinfo(name)
    with open(archive, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


@pytest.mark.slow  # 25-37 s on 2 cores (three builds): the heavy lane, which CI runs; zip reads stay in make test
def test_zipped_and_plain_trees_give_the_same_manifest_and_volumes(synth_tree, zipped_tree, tmp_path):
    assert not list(zipped_tree.rglob("*.dcm")) and len(list(zipped_tree.rglob("*.zip"))) == 8
    plain_rows, _ = build.build_sources(str(synth_tree))
    zip_rows, summary = build.build_sources(str(zipped_tree))
    pd.testing.assert_frame_equal(frame(zip_rows, SOURCE_ONLY[:2]), frame(plain_rows, SOURCE_ONLY[:2]))
    assert summary["archives"]["members"] == len(plain_rows) - 1 == summary["archives"]["matched"]
    for r in zip_rows:
        if r["manifest_error"]:  # the one listed-but-missing file
            assert r["manifest_error"].startswith("missing:")
            continue
        archive, member = fsio.split_member_uri(r["source"])
        assert r["source"].startswith("zip://") and archive.startswith(str(zipped_tree) + f"/{OCT}/")
        assert archive.endswith(("/part1.zip", "/part2.zip"))
        # the layout rule: the archive's folder + the member name is the manifest.tsv path
        assert r["relpath"] == archive[len(str(zipped_tree)) + 1:].rsplit("/", 1)[0] + "/" + member
        assert r["source_version"].startswith("zip crc32:")

    caches = {}
    for name, src in (("plain", synth_tree), ("zipped", zipped_tree)):
        caches[name] = tmp_path / name
        r = run_cli("cache.build", "--source", str(src), "--cache", str(caches[name]), "--no-progress", *SMALL)
        assert r.returncode == 0, r.stderr
    plain = pd.read_parquet(caches["plain"] / "manifest.parquet")
    zipped = pd.read_parquet(caches["zipped"] / "manifest.parquet")
    drop = SOURCE_ONLY + list(schema.TIMING_COLUMNS)
    pd.testing.assert_frame_equal(frame(zipped, drop), frame(plain, drop))
    skipped = (zipped.status == "skipped").sum()  # radial scans, decided by name: never read
    assert skipped and (zipped.status == "ok").sum() == len(zipped) - 5 - skipped
    assert zipped.sha1.notna().sum() >= len(zipped) - 1 - skipped
    read = zipped.source_version.notna()
    assert not zipped[read].cache_key.isin(plain.cache_key).any()  # identity is the member's, not the file's
    for vol in plain.volume.dropna():
        a = store.read_volume(str(caches["zipped"]), vol)
        assert a.tobytes() == store.read_volume(str(caches["plain"]), vol).tobytes()
    r = run_cli("cache.build", "--source", str(zipped_tree), "--cache", str(caches["zipped"]), "--no-progress", *SMALL)
    reused = (zipped.status == "ok").sum() + skipped
    assert re.search(rf"\b{reused} reused", r.stdout) and "rebuilding" not in r.stdout, r.stdout


@pytest.fixture(scope="module")
def damaged_tree(zipped_tree, tmp_path_factory):
    """The zipped tree with one truncated archive, one stored member with a flipped byte, an
    unlisted .dcm, a non-DICOM member and a member name that tries to climb out."""
    root = tmp_path_factory.mktemp("damaged") / "dataset"
    shutil.copytree(zipped_tree, root)
    truncated = root / OCT / "topcon_maestro2/part2.zip"
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    stored = root / OCT / "topcon_triton/part2.zip"
    with zipfile.ZipFile(stored) as zf:
        victim = next(i for i in zf.infolist() if "_oct_r_" in i.filename)
        assert victim.compress_type == zipfile.ZIP_STORED
    raw = bytearray(stored.read_bytes())
    raw[member_data_offset(stored, victim.filename) + victim.file_size // 2] ^= 0xFF
    stored.write_bytes(bytes(raw))
    with zipfile.ZipFile(root / OCT / "topcon_triton/part1.zip", "a") as zf:
        zf.writestr("1001/1001_triton_extra.dcm", b"not listed in manifest.tsv")
        zf.writestr("README.txt", b"notes")
        zf.writestr("../../../escape.dcm", b"zip slip")
    return root, victim.filename


def test_damaged_archives_fail_only_their_own_members(zipped_tree, damaged_tree, tmp_path):
    root, victim = damaged_tree
    out = tmp_path / "sources.parquet"
    r = run_cli("manifests.build", "--source", str(root), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "archive unreadable, its rows failed: retinal_oct/structural_oct/topcon_maestro2/part2.zip" in r.stdout
    assert "1 other member(s) ignored" in r.stdout and "README.txt" in r.stdout
    r = run_here("cache.build", "--source", str(root), "--cache", str(tmp_path / "cache"), "--no-progress", *SMALL)
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(tmp_path / "cache" / "manifest.parquet").set_index("relpath")
    ref = pd.DataFrame(build.build_sources(str(zipped_tree))[0]).set_index("relpath")

    in_truncated = [p for p in ref.index if p.startswith(f"{OCT}/topcon_maestro2/")
                    and ref.loc[p, "source"].endswith("part2.zip")]
    assert in_truncated
    for p in in_truncated:
        assert df.loc[p, "status"] == "failed" and df.loc[p, "error"].startswith("corrupt archive: "), df.loc[p, "error"]
        assert "part2.zip" in df.loc[p, "error"]
    bad = f"{OCT}/topcon_triton/{victim}"
    assert df.loc[bad, "status"] == "failed" and df.loc[bad, "error"].startswith("bad CRC: part2.zip: Bad CRC-32")
    extra = df.loc[f"{OCT}/topcon_triton/1001/1001_triton_extra.dcm"]
    assert not extra.listed and extra.status == "failed" and extra.error.startswith("not DICOM")
    escape = df[df.index.str.endswith("escape.dcm")]
    assert len(escape) == 1 and escape.error.iloc[0].startswith("bad path in archive")
    # everything else is exactly as in the undamaged tree
    others = [p for p in ref.index if p not in in_truncated and p != bad]
    assert list(df.loc[others, "status"]) == ["failed" if "_bad_" in p else "skipped" if "_onh_rc_" in p else "ok"
                                              for p in others]

    dst = tmp_path / "expanded"
    r = run_cli("ingest.expand", "--source", str(root), "--dst", str(dst), "--no-progress", "--strict")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "1 unreadable archive(s)" in r.stdout and "bad CRC" in r.stdout and "bad path in archive" in r.stdout
    assert not (dst / OCT / "topcon_triton" / victim).exists()
    assert not list(tmp_path.rglob("escape.dcm")) and not list(dst.rglob("*.tmp-*"))
    written = {p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()}
    assert written >= {p for p in others if "bad_missing" not in p}
    assert f"{OCT}/topcon_triton/README.txt" in written


def test_expand_round_trip_and_resume(tmp_path):
    """`synth --zipped` expanded equals the plain tree byte for byte; a re-run copies
    nothing; a damaged or deleted destination file is copied again."""
    cfg = dict(participants=4, scale=16, seed=3)
    synth.generate(tmp_path / "plain", synth.SynthConfig(**cfg))
    r = run_cli("ingest.synth", "--out", str(tmp_path / "zipped"), "--zipped",
                *[f"--{k}={v}" for k, v in cfg.items()])
    assert r.returncode == 0 and "ZIP archives" in r.stdout, r.stderr
    dst = tmp_path / "expanded"
    r = run_cli("ingest.expand", "--source", str(tmp_path / "zipped"), "--dst", str(dst), "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    plain = {p.relative_to(tmp_path / "plain").as_posix(): p.read_bytes()
             for p in (tmp_path / "plain").rglob("*") if p.is_file()}
    got = {p.relative_to(dst).as_posix(): p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    assert got.keys() == plain.keys() and all(got[k] == plain[k] for k in plain)
    assert f"copied {len(plain)} " in r.stdout

    r = run_cli("ingest.expand", "--source", str(tmp_path / "zipped"), "--dst", str(dst), "--no-progress")
    assert "copied 0 " in r.stdout and f"skipped {len(plain)} " in r.stdout, r.stdout
    dcms = sorted(dst.rglob("*.dcm"))
    damaged = bytearray(dcms[0].read_bytes())
    damaged[len(damaged) // 2] ^= 1  # same size: only the CRC can tell
    dcms[0].write_bytes(bytes(damaged))
    dcms[1].unlink()
    r = run_cli("ingest.expand", "--source", str(tmp_path / "zipped"), "--dst", str(dst), "--no-progress")
    assert "copied 2 " in r.stdout, r.stdout
    assert dcms[0].read_bytes() == plain[dcms[0].relative_to(dst).as_posix()] and dcms[1].exists()
    r = run_cli("ingest.expand", "--source", str(tmp_path / "zipped"), "--dst", str(tmp_path / "zipped" / "x"))
    assert r.returncode == 2 and "inside SOURCE" in r.stderr


@pytest.mark.slow  # about 20 s on 2 cores; the zipped tree itself stays in make test: the heavy lane, which CI runs
def test_zipped_sources_on_gcs(gcs_emulator, tmp_path):
    """Archives on gs:// (the emulator): members read by range into a cache, and expanded
    gs:// -> gs://, resumably."""
    plain = tmp_path / "plain"
    synth.generate(plain, synth.SynthConfig(participants=4, scale=16, seed=6, bad_files=False))
    zipped = tmp_path / "zipped"
    shutil.copytree(plain, zipped)
    synth.zip_layout(zipped)
    fs = gcs_bucket("zip-bucket")
    fs.put(f"{zipped}/", "zip-bucket/ds/", recursive=True)
    fs.invalidate_cache()
    cache = tmp_path / "cache"
    r = run_cli("cache.build", "--source", "gs://zip-bucket/ds", "--cache", str(cache), "--no-progress", *SMALL)
    assert r.returncode == 0, r.stdout + r.stderr
    df = pd.read_parquet(cache / "manifest.parquet")
    assert (df.status == "ok").sum() == (df.scan_pattern == "raster").sum() and (df.status != "failed").all() and len(df) == len(list(plain.rglob("*.dcm")))
    assert df.source.str.match(r"zip://\d+/.+\.dcm::gs://zip-bucket/ds/retinal_oct/.+/part\d\.zip$").all()
    read = df[df.status == "ok"]  # the radial scans are skipped by name, never read
    for rel, sha1 in zip(read.relpath, read.sha1):
        assert sha1 == hashlib.sha1((plain / rel).read_bytes()).hexdigest()

    r = run_cli("ingest.expand", "--source", "gs://zip-bucket/ds", "--dst", "gs://zip-bucket/expanded", "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    fs.invalidate_cache()
    files = [p for p in plain.rglob("*") if p.is_file()]
    for p in files:
        assert fs.cat_file(f"zip-bucket/expanded/{p.relative_to(plain).as_posix()}") == p.read_bytes()
    r = run_cli("ingest.expand", "--source", "gs://zip-bucket/ds", "--dst", "gs://zip-bucket/expanded", "--no-progress")
    assert "copied 0 " in r.stdout and f"skipped {len(files)} " in r.stdout, r.stdout


# VmHWM (peak RSS of this process image; ru_maxrss would carry pytest's peak across exec),
# reset after the imports through /proc/self/clear_refs
PEAK_SCRIPT = """
import json, sys
from octfm import archives, fsio
def status_mb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
archive, member, whole = sys.argv[1], sys.argv[2], sys.argv[3] == "whole"
fs, path = fsio.filesystem(archive)
fs.info(path)  # imports (gcsfs) and the HTTP session are not what we measure
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_mb("VmRSS")
except OSError:  # kernels that refuse the reset: the peak so far is the baseline
    before = status_mb("VmHWM")
if whole:  # the old way: the whole archive in memory
    n = len(fsio.read_bytes(archive))
else:
    members = archives.list_members(archive, "x/a.zip")
    n = len(fsio.read_bytes(fsio.member_uri(archive, member)))
print(json.dumps({"before_mb": before, "peak_mb": status_mb("VmHWM"), "bytes": n}))
"""


@pytest.mark.parametrize("where", ["local", "gs"])
def test_reading_one_member_of_a_large_archive_keeps_memory_bounded(where, tmp_path, request):
    """A 160 MB archive of stored members: listing it and reading one 5 MB member raises
    the peak RSS by about 5 MB (gs://: about 16 MB with gcsfs's read-ahead and HTTP buffers); reading the whole
    archive (the control) by at least its size."""
    archive = tmp_path / "big.zip"
    rng = np.random.default_rng(0)
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        for i in range(32):
            zf.writestr(f"{1000 + i}/vol.dcm", rng.bytes(5 << 20))
    size_mb = archive.stat().st_size / 2**20
    assert size_mb > 150
    uri = str(archive)
    if where == "gs":
        request.getfixturevalue("gcs_emulator")
        gcs_bucket("mem-bucket").put(str(archive), "mem-bucket/big.zip")
        uri = "gs://mem-bucket/big.zip"
    peaks = {}
    for mode in ("member", "whole"):
        r = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, uri, "1020/vol.dcm", mode], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        peaks[mode] = json.loads(r.stdout)
    member_growth = peaks["member"]["peak_mb"] - peaks["member"]["before_mb"]
    whole_growth = peaks["whole"]["peak_mb"] - peaks["whole"]["before_mb"]
    assert peaks["member"]["bytes"] == 5 << 20
    # README's numbers (docs/measurements.md): about 5 MB locally (the member; measured 4.9),
    # about 16 MB on gs:// (plus gcsfs's read-ahead block and HTTP buffers; measured 15.6)
    assert member_growth < (20 if where == "gs" else 7), peaks
    assert whole_growth > 0.9 * size_mb, peaks  # the measurement does see a whole-archive read
    if where == "gs":
        gcs_bucket("mem-bucket").rm("mem-bucket/big.zip")  # the emulator keeps objects in memory
