"""Real servers on loopback: rclone from an S3 server (moto, as B2 speaks S3) to a GCS
emulator; the cache built from gs:// sources into a gs:// cache; staging with rclone."""

import hashlib
import re

import numpy as np
import pandas as pd
import pytest
import zarr
from conftest import SMALL, gcs_bucket, run_cli, run_here, s3_env, upload_tree

from ome_zarr_models.v05.image import Image

from cache import store


@pytest.mark.slow  # the whole B2 -> GCS -> cache chain, about 32 s: the heavy lane; make test keeps the local mirror and gs:// reads
def test_mirror_s3_to_gcs_then_cache_from_gs(synth_tree, s3_server, gcs_emulator, tmp_path, no_ca_bundle):
    n = upload_tree(s3_server, "aireadi", synth_tree)
    fs = gcs_bucket("mirror-bucket")
    env = s3_env(s3_server)
    r = run_cli("ingest.mirror", "--src", "b2:aireadi/dataset", "--dst", "gs://mirror-bucket/dataset",
                "--no-progress", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{n} files" in r.stdout and f"copied {n} this run" in r.stdout
    assert "verified" in r.stdout
    record = pd.read_parquet(fs.open("mirror-bucket/dataset/octfm_mirror.parquet"))
    assert len(record) == n and record.verified.all()
    # S3 listings carry MD5 (ETag), not SHA-1: the record says so for every file
    assert record.sha1.isna().all() and record.md5.notna().all()
    assert record.hash_note.str.startswith("no SHA-1").all()
    fs.invalidate_cache()
    assert fs.du("mirror-bucket/dataset") > 0

    r = run_cli("ingest.mirror", "--src", "b2:aireadi/dataset", "--dst", "gs://mirror-bucket/dataset",
                "--no-progress", env=env)
    assert r.returncode == 0 and "copied 0 this run" in r.stdout, r.stdout + r.stderr

    cache = "gs://mirror-bucket/cache"
    r = run_cli("cache.build", "--source", "gs://mirror-bucket/dataset", "--cache", cache, "--no-progress", *SMALL)
    assert r.returncode == 0, r.stdout + r.stderr
    df = pd.read_parquet(fs.open("mirror-bucket/cache/manifest.parquet/part-0000-of-0001.parquet"))
    skipped = (df.status == "skipped").sum()  # the radial scans, by their name: never read
    assert skipped and (df.status == "ok").sum() == len(df) - 5 - skipped
    assert df.expected_md5.notna().sum() >= len(df) - 1  # the mirror record's MD5s reached the rows
    assert df.source.str.startswith("gs://mirror-bucket/dataset/").all()

    local = tmp_path / "local"
    r = run_cli("cache.build", "--source", str(synth_tree), "--cache", str(local), "--no-progress", *SMALL)
    assert r.returncode == 0, r.stdout + r.stderr
    ref = pd.read_parquet(local / "manifest.parquet")
    for vol in ref.volume.dropna():
        np.testing.assert_array_equal(store.read_volume(cache, vol), store.read_volume(str(local), vol))
    # OME-Zarr on the emulator too: an independent reader validates a volume and reads its bytes
    vol = ref.volume.dropna().iloc[0]
    group = zarr.open_group(store=store._store(f"{cache}/{vol}", True), mode="r")
    (path,) = Image.from_zarr(group).ome_attributes.get_array_paths()
    assert group[path][...].tobytes() == store.read_volume(str(local), vol).tobytes()

    r = run_cli("cache.build", "--source", "gs://mirror-bucket/dataset", "--cache", cache, "--no-progress", *SMALL)
    assert r.returncode == 0 and re.search(rf"\b{(df.status == 'ok').sum() + skipped} reused", r.stdout), r.stdout

    staged = tmp_path / "staged"
    r = run_cli("cache.stage", "--cache", cache, "--local", str(staged), "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verified" in r.stdout
    staged_df = pd.read_parquet(staged / "manifest.parquet")
    assert len(staged_df) == len(df)
    for vol in ref.volume.dropna():
        np.testing.assert_array_equal(store.read_volume(str(staged), vol), store.read_volume(str(local), vol))


def test_local_mirror_records_sha1_and_cache_catches_a_changed_file(synth_tree, tmp_path):
    dst = tmp_path / "gcs"
    r = run_cli("ingest.mirror", "--src", str(synth_tree), "--dst", str(dst), "--no-progress")
    assert r.returncode == 0, r.stderr
    record = pd.read_parquet(dst / "octfm_mirror.parquet")
    assert record.sha1.notna().all() and record.verified.all()
    victim = sorted(dst.rglob("*_triton_3d_radial_oct_oct_r_*.dcm"))[0]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # same size, different content: rclone's size check cannot see it
    victim.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    r = run_here("cache.build", "--source", str(dst), "--cache", str(cache), "--no-progress", *SMALL)
    assert r.returncode == 0
    df = pd.read_parquet(cache / "manifest.parquet")
    row = df[df.relpath.str.endswith(victim.name)].iloc[0]
    assert row.status == "failed"  # the SHA-1 check's own message (the record has an MD5 too, checked after it)
    assert row.error == (f"checksum mismatch: SHA-1 {hashlib.sha1(victim.read_bytes()).hexdigest()} differs from the "
                         f"mirror record {row.expected_sha1}")
    assert (df[df.status == "ok"].sha1 == df[df.status == "ok"].expected_sha1).all()


def test_stage_reports_verification_failure_for_missing_source(tmp_path):
    r = run_cli("cache.stage", "--cache", str(tmp_path / "nothing"), "--local", str(tmp_path / "x"), "--no-progress")
    assert r.returncode in (1, 2) and ("no files" in r.stderr or "could not list" in r.stderr)


@pytest.mark.slow
def test_checkpoints_on_gs_and_resume_from_them(tiny_cache, gcs_emulator, tmp_path):
    from conftest import tiny_train_args

    from train import checkpoint

    fs = gcs_bucket("ckpt-bucket")
    args = tiny_train_args(tiny_cache, tmp_path / "runs", name="g", max_steps=4, ckpt_every=2,
                           ckpt_dir="gs://ckpt-bucket/runs/g")
    r = run_cli("train.pretrain", "--config", "configs/pretrain_smoke.yaml", "--no-progress", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ckpt-bucket/runs/g"))
    # latest.pt: through the pointer; the run's config and metrics beside them make the folder a run (RUN=gs://...)
    assert names == ["config.yaml", "latest.txt", "metrics.jsonl", "step_0000002.pt", "step_0000004.pt"]
    st = checkpoint.load("gs://ckpt-bucket/runs/g/latest.pt")
    assert st["step"] == 4
    r = run_cli("train.pretrain", "--config", "configs/pretrain_smoke.yaml", "--no-progress",
                *(args[:-1] + ["max_steps=6", "ckpt_dir=gs://ckpt-bucket/runs/g"]))
    assert r.returncode == 0 and "resumed from gs://ckpt-bucket/runs/g/step_0000004.pt at step 4" in r.stdout, r.stdout
