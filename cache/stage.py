"""`make stage CACHE=gs://... LOCAL=...`: copy a cache to local SSD with rclone, then verify.

The copy is `make mirror`'s (octfm/rclone_io.copy: rclone's retries with backoff, and a clean
abort naming the last errors when rclone gives up). Verification is `rclone check --one-way` with MD5 (GCS stores it; local files are hashed),
so every byte the trainer will read is compared, not only sizes.
"""
from __future__ import annotations

import argparse
import time
from typing import Sequence

from rclone_python import rclone

from octfm import cli, rclone_io


def stage(cache: str, local: str, transfers: int = 32, progress: bool = True,
          retries: rclone_io.Retries = rclone_io.Retries()) -> dict:
    rclone_io.setup()
    src = rclone_io.remote_path(cache)
    t0 = time.perf_counter()
    files = rclone_io.list_files(src)
    if not files:
        raise cli.UsageError(f"CACHE={cache}: no files found")
    rclone_io.copy(src, local, transfers, 64, progress, retries, rerun="make stage")
    ok, report = rclone.check(src, local, one_way=True, args=["--fast-list", "--checkers 64"])
    bad = [(sym, path) for sym, path in report if sym != "="]
    return {"files": len(files), "bytes": sum(int(f["Size"]) for f in files), "ok": ok and not bad, "bad": bad,
            "seconds": time.perf_counter() - t0}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make stage", description=__doc__)
    ap.add_argument("--cache", required=True, help="cache root to copy (gs://..., rclone path or folder)")
    ap.add_argument("--local", required=True, help="local destination (SSD)")
    ap.add_argument("--transfers", type=int, default=32)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    s = stage(a.cache, a.local, a.transfers, progress=not a.no_progress)
    print(f"stage: {a.cache} -> {a.local}: {s['files']} files, {s['bytes'] / 1e6:.1f} MB, {s['seconds']:.1f}s")
    problems = [f"{sym} {path}" for sym, path in s["bad"]] or ([] if s["ok"] else ["rclone check failed"])
    return cli.report_verification("stage", problems, f"{s['files']} files by content hash")


if __name__ == "__main__":
    cli.run(main)
