"""Load: thousands of volumes through the real build with bounded memory, and a
25,000-row manifest. Timings are printed for the record; the targets live in `make bench`."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import psutil

from conftest import REPO
from ingest import synth
from manifests import build as manifest_build
from manifests import splits


def _run_watching_memory(cmd: list[str], log: Path, timeout: float = 600) -> tuple[int, float, float]:
    """Run cmd; returns (status, peak RSS of the driver, peak RSS of any one other process
    in its tree: the forkserver and workers), in MB, sampled every 50 ms."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=f)
    driver = psutil.Process(proc.pid)
    peak_driver = peak_child = 0.0
    deadline = time.time() + timeout
    while proc.poll() is None:
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"{cmd} ran past {timeout}s")
        try:
            peak_driver = max(peak_driver, driver.memory_info().rss / 2**20)
            for child in driver.children(recursive=True):
                peak_child = max(peak_child, child.memory_info().rss / 2**20)
        except psutil.Error:
            pass
        time.sleep(0.05)
    assert proc.returncode == 0, log.read_text()[-2000:]
    return proc.returncode, peak_driver, peak_child


@pytest.mark.slow
def test_thousands_of_volumes_build_in_bounded_memory(tmp_path):
    sizes = {}
    for name, participants in (("small", 100), ("large", 900)):
        src = tmp_path / name
        n = synth.generate(src, synth.SynthConfig(participants=participants, scale=16, seed=3, bad_files=False))["good"]
        cache = tmp_path / f"{name}_cache"
        t0 = time.perf_counter()
        _, driver, child = _run_watching_memory([
            sys.executable, "-m", "cache.build", "--source", str(src), "--cache", str(cache), "--no-progress",
            "preprocess.target_shape=[8,32,32]", "workers=2", "flush_every_s=2"], tmp_path / f"{name}.log")
        df = pd.read_parquet(cache / "manifest.parquet")
        assert len(df) == n and (df.status == "ok").sum() == (df.scan_pattern == "raster").sum() and (df.status != "failed").all(), df.error.value_counts()
        sizes[name] = (n, driver, child, time.perf_counter() - t0)
    print("\nload:", {k: f"{n} volumes, driver {d:.0f} MB, worker {c:.0f} MB, {s:.1f}s" for k, (n, d, c, s) in sizes.items()})
    (_, d_small, c_small, _), (n_large, d_large, c_large, _) = sizes["small"], sizes["large"]
    assert n_large >= 2000
    # nine times the volumes: the driver keeps only rows (a few kB each), workers one volume at a time
    assert d_large - d_small < 60, sizes
    assert c_large - c_small < 60, sizes


@pytest.mark.slow  # about 27 s on 2 cores: the heavy lane, which CI runs
def test_a_25000_row_manifest_is_built_whole(tmp_path):
    root = tmp_path / "ds"
    synth.generate(root, synth.SynthConfig(participants=11112, seed=1, bad_files=False, placeholders=True))
    t0 = time.perf_counter()
    rows, summary = manifest_build.build_sources(str(root))
    seconds = time.perf_counter() - t0
    print(f"\nmanifest: {len(rows)} rows in {seconds:.1f}s")
    assert len(rows) >= 25_000 and summary["participants"] == 11112
    assert not [r for r in rows if r["manifest_error"]]
    assert all(r["listed"] and r["size"] == 0 for r in rows)
    assert splits.split_leaks(pd.DataFrame(rows)) == []
