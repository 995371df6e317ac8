import os
import random
import re
import signal
import subprocess
import sys

import numpy as np
import pandas as pd
import pydicom
import pytest
from pydicom.data import get_testdata_file

from cache import build, store
from conftest import SMALL, assert_same_cache, run_cli, run_here, start_build
from ingest import preprocess as prep
from ingest import phantom, synth
from manifests import schema
from octfm import config, fsio

# pydicom-data's and hand-made files carry no frame traces: their scan pattern is unknown, kept here
CFG = config.from_dict(build.CacheConfig, {"preprocess": {"target_shape": [16, 48, 48]}, "workers": 2,
                                           "select": {"scan_pattern": ["raster", "unknown"]}})


def test_real_files_in_four_transfer_syntaxes_cache_identically(tmp_path):
    """pydicom-data's emri_small (MR, 16-bit) as native, JPEG 2000, RLE and big endian,
    relabelled as OPT with the pixel data untouched, give the same cached volume."""
    cfg = config.to_dict(CFG)
    volumes, syntaxes = [], set()
    for name in ("emri_small.dcm", "emri_small_jpeg_2k_lossless.dcm", "emri_small_RLE.dcm", "emri_small_big_endian.dcm"):
        ds = pydicom.dcmread(get_testdata_file(name))
        ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = synth.OPT_SOP_CLASS
        ds.Modality = "OPT"
        path = tmp_path / name
        ds.save_as(path)
        row = {"relpath": f"retinal_oct/x/{name}", "source": str(path), "cache_key": "k", "size": None}
        out = build.process_row(row, cfg, str(tmp_path / "cache"), "t")
        assert out["status"] == "ok", out["error"]
        assert out["native_shape"] == [10, 64, 64] and out["bits_stored"] == 12  # 16-bit words, 12 bits used
        syntaxes.add(out["transfer_syntax"])
        volumes.append(store.read_volume(str(tmp_path / "cache"), out["volume"]))
    assert len(syntaxes) == 4
    for v in volumes[1:]:
        np.testing.assert_array_equal(v, volumes[0])
    assert volumes[0].std() > 10  # real content, not a blank


def test_wrong_sop_class_is_refused(tmp_path):
    path = get_testdata_file("emri_small.dcm")
    row = {"relpath": "retinal_oct/x/mr.dcm", "source": path, "cache_key": "k"}
    out = build.process_row(row, config.to_dict(CFG), str(tmp_path), "t")
    assert out["status"] == "failed" and out["error"].startswith("wrong SOP class")


def test_bad_files_become_failed_rows_and_strict_exits_3(synth_tree, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    lock = cache / ".build-0-of-1.lock"                    # one builder per shard: a live one refuses a second
    with fsio.pid_lock(lock):                              # held by this test's process
        r = run_cli("cache.build", "--source", str(synth_tree), "--cache", str(cache), "--no-progress", *SMALL)
    assert r.returncode == 2 and "another make cache is building shard 0/1" in r.stderr, r.stderr
    assert str(cache) in r.stderr and str(os.getpid()) in r.stderr and not (cache / "manifest.parquet").exists()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lock.write_text(str(gone.pid))                         # a killed build's lock is taken over
    r = run_here("cache.build", "--source", str(synth_tree), "--cache", str(cache), "--no-progress", *SMALL)
    assert r.returncode == 0, r.stderr
    assert f"taking over the lock of pid {gone.pid}" in r.stderr and not lock.exists()
    df = pd.read_parquet(cache / "manifest.parquet")
    failed = df[df.status == "failed"].set_index(df[df.status == "failed"].relpath.str.extract(r"bad_(\w+)\.dcm")[0])
    assert failed.loc["truncated", "error"].startswith("truncated pixel data")
    assert failed.loc["nopixels", "error"].startswith("no PixelData")
    assert failed.loc["frames", "error"].startswith("frame count mismatch: NumberOfFrames=")
    assert failed.loc["notdicom", "error"].startswith("not DICOM")
    assert failed.loc["missing", "error"].startswith("missing:")
    assert len(failed) == 5 and failed.volume.isna().all()
    skipped = df[df.status == "skipped"]                   # the radial disc scans: no volume, never failed
    assert len(skipped) and (skipped.scan_pattern == "radial").all() and skipped.volume.isna().all()
    assert skipped.skip_reason.str.startswith("not selected: scan_pattern radial").all() and skipped.error.isna().all()
    ok = df[df.status == "ok"]
    assert len(ok) == len(df) - 5 - len(skipped) and ok.error.isna().all()
    assert all(list(s) == [16, 48, 48] for s in ok["shape"])
    assert (ok.hi > ok.lo).all()
    assert "failure reason" in r.stdout and "total" in r.stdout
    r = run_here("cache.build", "--source", str(synth_tree), "--cache", str(cache), "--no-progress", "--strict", *SMALL)
    assert r.returncode == 3
    assert "5 processed" in r.stdout  # failed rows are retried, ok ones reused


def test_bad_config_key_exits_2_and_names_key(synth_tree, tmp_path):
    r = run_cli("cache.build", "--source", str(synth_tree), "--cache", str(tmp_path), "preprocess.target_shap=[1,2,3]")
    assert r.returncode == 2 and "preprocess.target_shap" in r.stderr


def test_subsampled_window_within_one_level_of_full():
    """On realistic volumes (Triton aspect, half native size) the strided window is within
    one intensity level of the full-volume window, from far fewer voxels."""
    cfg = prep.PreprocessConfig(window_samples=200_000)
    rng = np.random.default_rng(0)
    for lat in ("R", "L", "R"):
        vol = phantom.make_volume((128, 496, 256), rng, lat)
        full = prep.full_window(vol, cfg)
        sub = prep.window(vol, cfg)
        assert abs(sub[0] - full[0]) <= 1 and abs(sub[1] - full[1]) <= 1, (sub, full)


def test_histogram_quantiles_match_numpy():
    rng = np.random.default_rng(1)
    for dtype, high in ((np.uint8, 256), (np.uint16, 4096)):
        x = rng.integers(0, high, size=10_001, dtype=dtype)
        np.testing.assert_allclose(prep.quantiles(x, (1, 37.5, 99)), np.percentile(x, (1, 37.5, 99)))


def test_constant_volume_is_refused():
    with pytest.raises(Exception, match="constant volume"):
        prep.preprocess(np.full((4, 8, 8), 7, np.uint8), prep.PreprocessConfig(target_shape=(4, 8, 8)))


def test_a_raster_written_bottom_to_top_is_flipped_by_its_traces(tmp_path):
    """Orientation from the header: a volume whose frames run up the localizer (its traces say so)
    caches exactly like its upright twin; a file without traces keeps its order unless a config
    rule (preprocess.orientation) flips it."""
    from manifests.protocols import PROTOCOLS

    spec = synth.DEVICES["topcon_triton"]
    protocol = PROTOCOLS["triton macula 12x12 octa"]
    vol = phantom.make_volume((8, 62, 96), np.random.default_rng(5), "R")
    spacing = (0.1, 0.01, 0.01)
    outs = {}
    for name, data, traces, rules in (
            ("upright", vol, synth.localizer_traces(protocol, 8, 96, spacing), []),
            ("reversed", vol[::-1].copy(), synth.localizer_traces(protocol, 8, 96, spacing, reverse=True), []),
            ("untraced", vol[::-1].copy(), None, []),
            ("ruled", vol[::-1].copy(), None, [{"device": spec.name, "match": "", "axes": [0]}])):
        ds = synth.make_dataset(data, spec, spacing, participant="1", laterality="R", sop_uid=f"1.2.3.{len(outs)}",
                                study_uid="1.2", series_uid="1.2.4", protocol_name=protocol.header_name, traces=traces)
        path = tmp_path / f"{name}.dcm"
        path.write_bytes(synth.dicom_bytes(ds))
        row = {"relpath": f"retinal_oct/structural_oct/{spec.name}/1/{name}.dcm", "source": str(path),
               "cache_key": "k", "device": spec.name}
        cfg = config.to_dict(config.from_dict(build.CacheConfig, {**config.to_dict(CFG), "preprocess": {
            **config.to_dict(CFG.preprocess), "orientation": rules}}))
        out = build.process_row(row, cfg, str(tmp_path / "c"), "t")
        assert out["status"] == "ok", out["error"]
        outs[name] = (out, store.read_volume(str(tmp_path / "c"), out["volume"]))
    assert [outs[k][0]["flipped_axes"] for k in outs] == [[], [0], [], [0]]
    assert outs["upright"][0]["scan_pattern"] == outs["reversed"][0]["scan_pattern"] == "raster"
    assert outs["untraced"][0]["scan_pattern"] == "raster"   # from the published protocol
    np.testing.assert_array_equal(outs["upright"][1], outs["reversed"][1])
    np.testing.assert_array_equal(outs["upright"][1], outs["ruled"][1])
    assert not np.array_equal(outs["upright"][1], outs["untraced"][1])


@pytest.mark.slow
def test_killed_build_resumes_to_the_same_result(tmp_path):
    src = tmp_path / "ds"
    synth.generate(src, synth.SynthConfig(participants=16, scale=4, seed=2))
    args = ["--no-progress", "preprocess.target_shape=[32,128,128]", "flush_every_s=0.2"]
    clean = tmp_path / "clean"
    assert run_cli("cache.build", "--source", str(src), "--cache", str(clean), *args).returncode == 0
    ref = pd.read_parquet(clean / "manifest.parquet")
    n_ok = (ref.status == "ok").sum()
    # kill -9 at four moments: right after the listing, then after a random number of volumes (seeded)
    moments = [0, *sorted(random.Random(0).sample(range(1, n_ok - 2), 3))]
    for trial, wait_for in enumerate(moments):
        cache = tmp_path / f"killed{trial}"
        proc = start_build(cache, ["--source", str(src), *args], wait_for, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        r = run_cli("cache.build", "--source", str(src), "--cache", str(cache), *args)
        assert r.returncode == 0, r.stderr
        reused = int(re.search(r"(\d+) reused", r.stdout).group(1))
        assert reused >= wait_for, (wait_for, r.stdout)  # what finished before the kill is not redone
        assert_same_cache(cache, clean)
        assert not [p for p in cache.rglob("*") if ".tmp-" in p.name], "temp arrays left behind"


@pytest.mark.slow  # about 35 s on 2 cores: the heavy lane, which CI runs
def test_shards_write_parts_that_read_back_as_one_table(synth_tree, tmp_path):
    cache = tmp_path / "cache"
    hosts = [(["--shard", "0/3"], {}, "from SHARD=0/3"),                                # explicit
             ([], {"BATCH_TASK_INDEX": "1", "BATCH_TASK_COUNT": "3"}, "(Cloud Batch)"),  # a scheduler's
             (["--shards", "3"], {"JOB_COMPLETION_INDEX": "2"}, "(Kubernetes Indexed Job)")]
    for i, (args, env, origin) in enumerate(hosts):
        r = run_cli("cache.build", "--source", str(synth_tree), "--cache", str(cache), *args, "--no-progress", *SMALL,
                    env=env)
        assert r.returncode == 0, r.stderr
        assert f"cache: shard {i}/3 " in r.stdout and origin in r.stdout, r.stdout
        assert re.search(rf"shard {i}/3: \d+ of \d+ files, [\d.]+ of [\d.]+ GB \(largest shard [\d.]+x the mean", r.stdout)
    parts = sorted((cache / "manifest.parquet").glob("part-*.parquet"))
    assert len(parts) == 3
    df = pd.read_parquet(cache / "manifest.parquet")  # plain pandas over the part directory
    assert df.relpath.is_unique and len(df) == len(pd.read_parquet(cache / "sources.parquet"))
    assert str(schema.read_table(str(parts[0])).schema.field("error").type) == "string"
    one = tmp_path / "one"
    r = run_cli("cache.build", "--source", str(synth_tree), "--cache", str(one), "--no-progress", *SMALL)
    assert r.returncode == 0, r.stderr
    single = pd.read_parquet(one / "manifest.parquet")
    assert sorted(single.relpath) == sorted(df.relpath)
    assert (single.sort_values("relpath").status.values == df.sort_values("relpath").status.values).all()


def test_changed_parameters_redo_volumes(synth_tree, tmp_path):
    cache = tmp_path / "cache"
    first = run_here("cache.build", "--source", str(synth_tree), "--cache", str(cache), "--no-progress", *SMALL)
    assert first.returncode == 0 and re.search(r"\b0 reused, [1-9]\d* processed", first.stdout), first.stdout
    r = run_here("cache.build", "--source", str(synth_tree), "--cache", str(cache), "--no-progress",
                 "preprocess.target_shape=[8,32,32]")
    df = pd.read_parquet(cache / "manifest.parquet")
    assert r.returncode == 0 and re.search(r"\b0 reused", r.stdout), r.stdout
    assert all(list(s) == [8, 32, 32] for s in df[df.status == "ok"]["shape"])


@pytest.mark.slow  # hundreds of rows through the pool, about 12 s: the heavy lane
def test_build_with_many_more_rows_than_workers_finishes(tmp_path):
    """Regression: with max_tasks_per_child the 3.11 pool hung once workers were replaced
    (seen at 128 tasks on 2 workers)."""
    src = tmp_path / "ds"
    synth.generate(src, synth.SynthConfig(participants=60, scale=16, seed=5, bad_files=False))
    r = run_cli("cache.build", "--source", str(src), "--cache", str(tmp_path / "c"), "--no-progress",
                "preprocess.target_shape=[8,16,16]", timeout=180)
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(tmp_path / "c" / "manifest.parquet")
    assert len(df) == 135 and (df.status == "ok").sum() == (df.scan_pattern == "raster").sum() and (df.status != "failed").all()  # radial scans: skipped
