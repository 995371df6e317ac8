"""`make stage CACHE=gs://... LOCAL=...`: copy a cache to local SSD with rclone, then verify.

The copy is `make mirror`'s (octfm/rclone_io.copy: rclone's retries with backoff, and a clean
abort naming the last errors when rclone gives up). Verification is `rclone check --one-way` with MD5 (GCS stores it; local files are hashed),
so every byte the trainer will read is compared, not only sizes. `make stage HOST=i HOSTS=n`
copies one host's share the same way (train/shares.py chooses the files and names the record
left beside them).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Callable, Sequence

from rclone_python import rclone

from octfm import cli, fsio, rclone_io

Pick = Callable[[dict[str, int]], tuple[list[str], dict]]


def stage(cache: str, local: str, transfers: int = 32, progress: bool = True,
          retries: rclone_io.Retries = rclone_io.Retries(), pick: Pick | None = None) -> dict:
    """Copy and verify the cache, or with `pick` ({path: bytes} of the listing -> (paths to copy,
    a record)) only the paths it picks, and leave that record in `local` as RECORD."""
    rclone_io.setup()
    src = rclone_io.remote_path(cache)
    t0 = time.perf_counter()
    files = rclone_io.list_files(src)
    if not files:
        raise cli.UsageError(f"CACHE={cache}: no files found")
    sizes = {f["Path"]: int(f["Size"]) for f in files}
    record = None
    if pick is not None:
        chosen, record = pick(sizes)
        sizes = {p: sizes[p] for p in chosen}
    with tempfile.TemporaryDirectory(prefix="octfm-stage-") as tmp:
        listed = None
        if record is not None:  # only the picked files: rclone's --files-from, for the copy and the check
            listed = os.path.join(tmp, "files.txt")
            with open(listed, "w") as f:
                f.write("".join(p + "\n" for p in sizes))
        extra = [f"--files-from {listed}"] if listed else []
        rclone_io.copy(src, local, transfers, 64, progress, retries, rerun="make stage", extra=tuple(extra))
        ok, report = rclone.check(src, local, one_way=True, args=["--fast-list", "--checkers 64", *extra])
    bad = [(sym, path) for sym, path in report if sym != "="]
    if record is not None:
        fsio.atomic_write_bytes(fsio.join(local, RECORD), json.dumps(record).encode())
    elif os.path.exists(os.path.join(local, RECORD)):  # the whole cache now: no longer one host's share
        os.remove(os.path.join(local, RECORD))
    return {"files": len(sizes), "bytes": sum(sizes.values()), "ok": ok and not bad, "bad": bad,
            "seconds": time.perf_counter() - t0}


RECORD = "octfm_stage.json"  # what a staging of one host's share left in LOCAL (train/shares.py reads it)


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
