"""`make mirror SRC=... DST=...`: copy the dataset between buckets with rclone, then verify.

B2 keeps SHA-1 and GCS MD5, so rclone can compare only sizes between them. We therefore
record, beside the copy, every source file's size and the hashes the source listing had
(`<DST>/octfm_mirror.parquet`); `make manifest`/`make cache` verify the bytes they read
against it. Files the listing had no SHA-1 for (B2 large files) are marked as such.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import datetime, timezone
from typing import Sequence

import pyarrow.parquet as pq
from rclone_python import rclone

from manifests import paths
from manifests.paths import MIRROR_RECORD
from octfm import cli, rclone_io
from octfm.rclone_io import Retries



def record_rows(src_files: list[dict], dst_files: list[dict], now: str) -> tuple[list[dict], list[str]]:
    """Mirror record rows and the verification problems (missing, size or MD5 differs)."""
    dst = {f["Path"]: f for f in dst_files}
    rows, problems = [], []
    for f in sorted(src_files, key=lambda f: f["Path"]):
        path = f["Path"]
        if path == MIRROR_RECORD:
            continue
        h = f.get("Hashes") or {}
        sha1, md5 = h.get("sha1") or None, h.get("md5") or None
        note = "sha1 from the source listing" if sha1 else "no SHA-1 in the source listing (B2 large file?)"
        d = dst.get(path)
        ok = d is not None and int(d["Size"]) == int(f["Size"])
        if d is None:
            problems.append(f"missing at destination: {path}")
        elif not ok:
            problems.append(f"size differs: {path}: source {f['Size']} B, destination {d['Size']} B")
        elif md5 and (d.get("Hashes") or {}).get("md5") and d["Hashes"]["md5"] != md5:
            ok = False
            problems.append(f"MD5 differs: {path}")
        rows.append({"path": path, "size": int(f["Size"]), "sha1": sha1, "md5": md5, "mod_time": f.get("ModTime"),
                     "hash_note": note, "verified": ok, "recorded_at": now})
    return rows, problems


def write_record(rows: list[dict], dst: str) -> None:
    table = paths.mirror_record_table(rows)
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, MIRROR_RECORD)
        pq.write_table(table, local, compression="zstd")
        rclone.copyto(local, f"{dst.rstrip('/')}/{MIRROR_RECORD}", show_progress=False)


def mirror(src: str, dst: str, transfers: int = 16, checkers: int = 32, progress: bool = True,
           retries: Retries = Retries()) -> dict:
    rclone_io.setup()
    src_r, dst_r = rclone_io.remote_path(src), rclone_io.remote_path(dst)
    t0 = time.perf_counter()
    src_files = rclone_io.list_files(src_r, hashes=("sha1", "md5"))
    if not src_files:
        raise cli.UsageError(f"SRC={src}: no files found (wrong remote or path?)")
    copied = rclone_io.copy(src_r, dst_r, transfers, checkers, progress, retries, exclude=(MIRROR_RECORD,),
                            rerun="make mirror")
    dst_files = rclone_io.list_files(dst_r, hashes=("md5",))
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    rows, problems = record_rows(src_files, dst_files, now)
    write_record(rows, dst_r)
    return {"files": len(rows), "bytes": sum(r["size"] for r in rows), "copied": copied, "problems": problems,
            "with_sha1": sum(bool(r["sha1"]) for r in rows), "with_md5": sum(bool(r["md5"]) for r in rows),
            "seconds": time.perf_counter() - t0}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make mirror", description=__doc__)
    ap.add_argument("--src", required=True, help="rclone path or local folder (e.g. b2:bucket/dataset)")
    ap.add_argument("--dst", required=True, help="rclone path, gs://bucket/path or local folder")
    ap.add_argument("--transfers", type=int, default=16)
    ap.add_argument("--checkers", type=int, default=32)
    ap.add_argument("--retries", type=int, default=Retries.passes, help="rclone --retries (whole passes)")
    ap.add_argument("--low-level-retries", type=int, default=Retries.low_level, help="rclone --low-level-retries")
    ap.add_argument("--retries-sleep", default=Retries.sleep, help="rclone --retries-sleep between passes")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    s = mirror(a.src, a.dst, a.transfers, a.checkers, progress=not a.no_progress,
               retries=Retries(a.retries, a.low_level_retries, a.retries_sleep))
    print(f"mirror: {a.src} -> {a.dst}: {s['files']} files, {s['bytes'] / 1e6:.1f} MB; copied {s['copied']} this run; "
          f"SHA-1 recorded for {s['with_sha1']}, MD5 for {s['with_md5']}; {s['seconds']:.1f}s")
    print(f"mirror: record written to {paths.mirror_record_uri(a.dst)}")
    return cli.report_verification("mirror", s["problems"],
                                   f"{s['files']} files (size{', MD5' if s['with_md5'] else ''})")


if __name__ == "__main__":
    cli.run(main)
