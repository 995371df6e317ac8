"""Faults injected into real runs: kills mid-save, a store that goes away, a full disk.

Each test says what was lost; the target is nothing.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import (
    REPO,
    assert_same_cache,
    gcs_bucket,
    run_cli,
    same_weights,
    start_build,
    tiny_train_args,
)

from cache import store
from ingest import synth
from train import checkpoint

SMOKE = "configs/pretrain_smoke.yaml"


@pytest.mark.slow
def test_kill_during_checkpoint_save_resumes_from_the_last_good_one(tiny_cache, tmp_path):
    """kill -9 when the step-8 checkpoint's bytes are down in its temp file but not renamed
    (a checkpoint torn after the rename is the next test)."""
    common = dict(max_steps=12, ckpt_every=4)
    ref = tiny_train_args(tiny_cache, tmp_path / "ref", name="r", **common)
    assert run_cli("train.pretrain", "--config", SMOKE, "--no-progress", *ref).returncode == 0
    args = tiny_train_args(tiny_cache, tmp_path / "run", name="r", **common)
    ckdir = tmp_path / "run" / "r" / "checkpoints"
    killed = subprocess.run([sys.executable, "tests/fault_inject.py", "--kill-at-fsync", "step_0000008.pt",
                             "-m", "train.pretrain", "--config", SMOKE,
                             "--no-progress", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert checkpoint.list_steps(str(ckdir)) == [4], "the interrupted save must not look like a checkpoint"
    assert [p for p in ckdir.iterdir() if ".tmp-" in p.name], "the kill should have left a temp file"

    r = run_cli("train.pretrain", "--config", SMOKE, "--no-progress", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and "step_0000004.pt" in r.stdout
    assert not [p for p in ckdir.iterdir() if ".tmp-" in p.name], "stale temp files are cleaned up"
    a = checkpoint.load(str(tmp_path / "ref" / "r" / "checkpoints" / "latest.pt"))
    b = checkpoint.load(str(ckdir / "latest.pt"))
    assert a["step"] == b["step"] == 12 and same_weights(a, b)


@pytest.mark.slow
def test_a_cut_short_checkpoint_is_skipped_for_the_one_before(tiny_cache, tmp_path):
    args = tiny_train_args(tiny_cache, tmp_path, name="c", max_steps=8, ckpt_every=4)
    assert run_cli("train.pretrain", "--config", SMOKE, "--no-progress", *args).returncode == 0
    ckdir = tmp_path / "c" / "checkpoints"
    newest = ckdir / "step_0000008.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])
    longer = tiny_train_args(tiny_cache, tmp_path, name="c", max_steps=10, ckpt_every=4)
    r = run_cli("train.pretrain", "--config", SMOKE, "--no-progress", *longer)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"checkpoint {newest} is unreadable" in r.stdout
    assert "resumed from" in r.stdout and "step_0000004.pt" in r.stdout
    assert checkpoint.load(str(ckdir / "latest.pt"))["step"] == 10


@pytest.mark.slow
def test_full_disk_stops_the_build_cleanly_and_a_rerun_completes(tmp_path, small_tmpfs):
    src = tmp_path / "ds"
    synth.generate(src, synth.SynthConfig(participants=8, scale=8, seed=6, bad_files=False))
    args = ["--no-progress", "preprocess.target_shape=[32,128,128]", "workers=1"]
    clean = tmp_path / "clean"
    assert run_cli("cache.build", "--source", str(src), "--cache", str(clean), *args).returncode == 0
    cache = small_tmpfs / "cache"
    r = run_cli("cache.build", "--source", str(src), "--cache", str(cache), *args)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "error: disk full" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not [p for p in cache.rglob("*") if ".tmp-" in p.name], "a temp array was left on the full disk"
    # no corrupt cache: whatever the manifest calls ok reads back equal to the clean build
    part = pd.read_parquet(cache / "manifest.parquet")
    ok = part[part.status == "ok"]
    assert 0 < len(ok) < len(part), part.status.value_counts()
    for vol in ok.volume:
        np.testing.assert_array_equal(store.read_volume(str(cache), vol), store.read_volume(str(clean), vol))
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
    r = run_cli("cache.build", "--source", str(src), "--cache", str(cache), *args)
    assert r.returncode == 0, r.stderr[-2000:]
    skipped = (part.status == "skipped").sum()  # decided by name, recorded before the disk filled: reused too
    assert re.search(rf"\b{len(ok) + skipped} reused", r.stdout), r.stdout
    assert_same_cache(cache, clean)


def _upload(fs, root: Path, prefix: str) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fs.pipe_file(f"{prefix}/{p.relative_to(root).as_posix()}", p.read_bytes())


@pytest.mark.slow
def test_object_store_going_away_mid_build_stops_cleanly_and_loses_nothing(tmp_path, restartable_gcs):
    src = tmp_path / "ds"
    synth.generate(src, synth.SynthConfig(participants=8, scale=8, seed=7, bad_files=False))
    _upload(gcs_bucket("faults"), src, "faults/ds")
    args = ["--source", "gs://faults/ds", "--no-progress", "preprocess.target_shape=[32,128,128]", "workers=1",
            "read_retries=1", "read_timeout_s=5", "abort_after_read_errors=1"]
    clean, cache = tmp_path / "clean", tmp_path / "cache"
    assert run_cli("cache.build", "--cache", str(clean), *args).returncode == 0
    proc = start_build(cache, args, 3, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    restartable_gcs.stop()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out + err
    assert "object store looks unreachable" in err and "Traceback" not in err, err[-3000:]
    assert "pending (not started" in out
    part = pd.read_parquet(cache / "manifest.parquet")
    ok = part[part.status == "ok"]
    assert len(ok) >= 3 and set(part.status) >= {"ok", "pending"}, part.status.value_counts()
    for vol in ok.volume:
        np.testing.assert_array_equal(store.read_volume(str(cache), vol), store.read_volume(str(clean), vol))

    restartable_gcs.start()
    r = run_cli("cache.build", "--cache", str(cache), *args)
    assert r.returncode == 0, r.stderr[-2000:]
    skipped = (part.status == "skipped").sum()  # decided by name before the store went: reused too
    assert re.search(rf"\b{len(ok) + skipped} reused", r.stdout), r.stdout
    assert_same_cache(cache, clean)


@pytest.mark.slow
def test_mirror_fails_clearly_when_the_store_is_away_then_copies_only_the_rest(tmp_path, restartable_gcs):
    src = tmp_path / "ds"
    synth.generate(src, synth.SynthConfig(participants=4, scale=16, seed=8, bad_files=False))
    gcs_bucket("mirror")
    quick = ["--no-progress", "--retries", "2", "--low-level-retries", "2", "--retries-sleep", "1s"]
    mirror = ["--src", str(src), "--dst", "gs://mirror/ds", *quick]
    assert run_cli("ingest.mirror", *mirror).returncode == 0
    for i in range(3):  # new files arrive in the source
        (src / "retinal_oct" / f"extra_{i}.txt").write_text(f"new {i}")
    restartable_gcs.stop()
    r = run_cli("ingest.mirror", *mirror, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "failed after 2 passes" in r.stderr and "re-run `make mirror`" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    restartable_gcs.start()
    r = run_cli("ingest.mirror", *mirror)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "copied 3 this run" in r.stdout, r.stdout


@pytest.mark.slow
def test_a_worker_killed_mid_volume_is_retried_and_nothing_is_lost(tmp_path):
    """The OOM killer or a decoder crash takes a worker down: its rows get a second try in a
    fresh pool, and the cache ends equal to a clean build."""
    import psutil

    src = tmp_path / "ds"
    synth.generate(src, synth.SynthConfig(participants=8, scale=4, seed=9))
    args = ["--source", str(src), "--no-progress", "preprocess.target_shape=[32,128,128]", "workers=2"]
    clean, cache = tmp_path / "clean", tmp_path / "cache"
    assert run_cli("cache.build", "--cache", str(clean), *args).returncode == 0
    proc = start_build(cache, args, 2, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if p.parent() is not None and "forkserver" in " ".join(p.parent().cmdline())]
    assert workers, "no worker process found"
    workers[0].kill()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert "a worker died" in err and "one at a time" in err
    assert_same_cache(cache, clean)


CRASH_HOOK = '''
import os
import ingest.dicom as dicom
_decode_pixels = dicom.decode_pixels
def decode_pixels(header, data, *args, **kwargs):
    if b"OCTFM-CRASH" in data:
        os._exit(139)  # what a segfaulting decoder looks like to the pool
    return _decode_pixels(header, data, *args, **kwargs)
dicom.decode_pixels = decode_pixels
'''


@pytest.mark.slow
def test_a_file_that_kills_its_worker_every_time_fails_alone(tmp_path):
    """The decoder crashes on one file: every row beside it in the pool is suspect, so each is
    tried again alone; the bad file fails with `worker crashed`, the others are cached."""
    import pydicom

    src = tmp_path / "ds"
    synth.generate(src, synth.SynthConfig(participants=8, scale=8, seed=10, bad_files=False))
    bad = sorted(src.rglob("*triton*.dcm"))[0]       # a raster volume: its pixels are decoded
    ds = pydicom.dcmread(bad)
    ds.ImageComments = "OCTFM-CRASH"
    ds.save_as(bad)
    bad_rel = bad.relative_to(src).as_posix()
    args = ["--source", str(src), "--no-progress", "preprocess.target_shape=[16,64,64]", "workers=2"]
    clean, cache = tmp_path / "clean", tmp_path / "cache"
    assert run_cli("cache.build", "--cache", str(clean), *args).returncode == 0
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CRASH_HOOK)  # loaded by every process: driver, forkserver, workers
    r = run_cli("cache.build", "--cache", str(cache), *args, env={"PYTHONPATH": f"{hook}{os.pathsep}{REPO}"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "trying its" in r.stderr and "one at a time" in r.stderr
    df = pd.read_parquet(cache / "manifest.parquet").set_index("relpath")
    assert df.loc[bad_rel, "status"] == "failed" and df.loc[bad_rel, "error"].startswith("worker crashed"), \
        df.loc[bad_rel, "error"]
    rest = df.drop(index=bad_rel)
    assert ((rest.status == "ok") == (rest.scan_pattern == "raster")).all() and (rest.status != "failed").all()
    assert_same_cache(cache, clean, except_paths=(bad_rel,))


def test_no_readable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    (tmp_path / "step_0000004.pt").write_bytes(b"PK\x03\x04 torn")
    (tmp_path / "step_0000002.pt").write_bytes(b"")
    warnings: list[str] = []
    with pytest.raises(RuntimeError, match="no checkpoint in .* reads back whole"):
        checkpoint.load_newest_good(str(tmp_path), warn=warnings.append)
    assert len(warnings) == 2
    (tmp_path / "empty").mkdir()
    assert checkpoint.load_newest_good(str(tmp_path / "empty")) is None  # a new run starts from scratch


def test_a_zip_member_read_has_a_deadline_when_the_store_is_away(tmp_path, restartable_gcs):
    import io
    import zipfile

    from octfm import fsio

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("1001/x.dcm", b"DICM" * 1000)
    gcs_bucket("zips").pipe_file("zips/part1.zip", buf.getvalue())
    uri = "zip://1001/x.dcm::gs://zips/part1.zip"
    assert fsio.read_bytes(uri, timeout=30) == b"DICM" * 1000
    restartable_gcs.stop()
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="no answer within 3s"):
        fsio.read_bytes(uri, timeout=3)
    assert time.perf_counter() - t0 < 10


def test_expand_onto_a_full_disk_stops_cleanly_and_a_rerun_completes(tmp_path, small_tmpfs):
    cfg = dict(participants=8, scale=4, seed=11, bad_files=False)
    synth.generate(tmp_path / "plain", synth.SynthConfig(**cfg))
    synth.generate(tmp_path / "zipped", synth.SynthConfig(**cfg, zipped=True))
    dst = small_tmpfs / "expanded"
    (dst / "retinal_oct").mkdir(parents=True)
    stale = dst / "retinal_oct" / ".manifest.tsv.tmp-abc123"  # left by an earlier run killed mid-write
    stale.write_bytes(b"partial")
    expand = ["--source", str(tmp_path / "zipped"), "--dst", str(dst), "--no-progress", "--workers", "1"]
    r = run_cli("ingest.expand", *expand)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "error: disk full under DST" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not [p for p in dst.rglob("*") if ".tmp-" in p.name], "temp files left on the full disk"
    plain = {p.relative_to(tmp_path / "plain").as_posix(): p.read_bytes()
             for p in (tmp_path / "plain").rglob("*") if p.is_file()}
    written = {p.relative_to(dst).as_posix(): p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    assert written and all(written[k] == plain[k] for k in written), "a file on disk differs from its source"
    assert len(written) < len(plain)
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
    r = run_cli("ingest.expand", *expand)
    assert r.returncode == 0, r.stdout + r.stderr
    got = {p.relative_to(dst).as_posix(): p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    assert got == plain
