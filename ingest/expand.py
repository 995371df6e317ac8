"""`make expand SOURCE=<zipped dataset> DST=<folder or gs://>`: ZIP members out as plain files.

Optional: `make manifest` and `make cache` read members in place. This is for users who want
a plain tree. Each member goes to DST/<the path it stands for> (octfm/archives.py: the
archive's folder joined with the member name; relative POSIX paths without `..`, the ones
manifest.tsv lists and rclone and `make mirror` copy as they are), or, where the OCT manifest.tsv
lists it at another path (a repacked bucket: <root>/<device>/x.zip with members <pid>/<file>), to
that path, found by file name as `make manifest` finds it; every other file (participants.tsv,
manifest.tsv, ...) is copied as is, so DST is an ordinary dataset root.

Streaming: a file is copied in chunks while its CRC-32 is computed, never held whole in
memory; it is kept (atomically) only when that CRC equals the archive's and the size written
equals the member's. Resumable: a destination that already has the size and CRC-32 is
skipped. One bad archive fails its own members; the others proceed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from tqdm import tqdm

from manifests.paths import MIRROR_RECORD
from octfm import archives, cli, fsio
from octfm.errors import DataError

CHUNK = 4 << 20


class VerifyError(Exception):
    """What was written is not what the archive says it holds."""


def file_sizes(root: str) -> dict[str, int]:
    """relpath -> size of every file under `root`, from one listing ({} when absent)."""
    return {rel: int(info.get("size") or 0) for rel, info in fsio.list_tree(root).items()}


def file_crc(uri: str) -> int:
    fs, path = fsio.filesystem(uri)
    crc = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def copy_verified(src, dst_uri: str, size: int, crc: int | None) -> int:
    """Stream the open file `src` to `dst_uri`; the destination appears only when the bytes
    have `size` and, when given, CRC-32 `crc`. Returns their CRC-32."""
    got, n = 0, 0
    with fsio.atomic_writer(dst_uri) as out:
        while chunk := src.read(CHUNK):
            got = zlib.crc32(chunk, got)
            n += len(chunk)
            out.write(chunk)
        if n != size:
            raise VerifyError(f"size mismatch: read {n} bytes, the listing said {size}")
        if crc is not None and got != crc:
            raise VerifyError(f"bad CRC: CRC-32 {got:08x} of the bytes read, the archive recorded {crc:08x}")
    fs, path = fsio.filesystem(dst_uri)
    if fs.size(path) != size:
        raise VerifyError(f"size mismatch after writing: {fs.size(path)} bytes at the destination, expected {size}")
    return got


def already_there(dst_uri: str, size: int, crc: int, existing: dict, rel: str) -> bool:
    return existing.get(rel) == size and file_crc(dst_uri) == crc


def stop_if_disk_full(exc: BaseException, dst: str) -> None:
    """A full disk is not the member's fault and would fail every one left: stop the job."""
    if fsio.is_disk_full(exc):
        raise cli.JobAborted(f"disk full under DST={dst} ({exc.strerror}). Files written so far are verified and "
                             "kept; nothing partial is left: free space and re-run `make expand`.") from None


def expand_archive(source: str, dst: str, rel: str, members: list[archives.Member], existing: dict,
                   tick) -> list[dict]:
    """Write one archive's members; each member's outcome is a result row."""
    results, todo = [], []
    for m in members:
        if m.error:
            results.append({"path": m.relpath, "status": "failed", "error": m.error, "bytes": 0})
            tick(m.size)
        elif already_there(fsio.join(dst, m.relpath), m.size, m.crc, existing, m.relpath):
            results.append({"path": m.relpath, "status": "skipped", "bytes": 0})
            tick(m.size)
        else:
            todo.append(m)
    if not todo:
        return results
    try:
        with archives.open_archive(fsio.join(source, rel)) as zf:
            for m in todo:
                try:
                    with zf.open(m.name) as f:
                        copy_verified(f, fsio.join(dst, m.relpath), m.size, m.crc)
                    results.append({"path": m.relpath, "status": "copied", "bytes": m.size})
                except Exception as exc:  # noqa: BLE001 - one bad member never stops the others
                    stop_if_disk_full(exc, dst)
                    reason = archives.read_failure(exc, m.uri) or f"{type(exc).__name__}: {exc}"
                    results.append({"path": m.relpath, "status": "failed", "error": reason, "bytes": 0})
                tick(m.size)
    except (archives.ArchiveError, OSError) as exc:  # the archive went away or broke after the listing
        done = {r["path"] for r in results}
        results += [{"path": m.relpath, "status": "failed", "error": str(exc), "bytes": 0}
                    for m in todo if m.relpath not in done]
    return results


def copy_plain(source: str, dst: str, rel: str, size: int, existing: dict, tick) -> list[dict]:
    src_uri, dst_uri = fsio.join(source, rel), fsio.join(dst, rel)
    try:
        if existing.get(rel) == size and file_crc(dst_uri) == file_crc(src_uri):
            return [{"path": rel, "status": "skipped", "bytes": 0}]
        fs, path = fsio.filesystem(src_uri)
        with fs.open(path, "rb") as f:
            got = copy_verified(f, dst_uri, size, None)
        if file_crc(dst_uri) != got:
            raise VerifyError("bad CRC: the destination's CRC-32 differs from the bytes written")
        return [{"path": rel, "status": "copied", "bytes": size}]
    except Exception as exc:  # noqa: BLE001
        stop_if_disk_full(exc, dst)
        return [{"path": rel, "status": "failed", "error": f"{type(exc).__name__}: {exc}", "bytes": 0}]
    finally:
        tick(size)


def check_roots(source: str, dst: str) -> None:
    def norm(u: str) -> str:
        return u.rstrip("/") if fsio.is_remote(u) else os.path.abspath(u)
    s, d = norm(source), norm(dst)
    if d == s or d.startswith(s + "/"):
        raise cli.UsageError(f"DST={dst} is inside SOURCE={source}: choose a folder outside the zipped dataset")


def manifest_paths(source: str, members: list[archives.Member]) -> dict[str, str]:
    """Member path -> the path the OCT manifest.tsv lists for it, where the two differ (the member
    found by its file name, as `make manifest` finds it); {} without a manifest."""
    from manifests import aireadi
    from manifests import build as manifest_build

    try:
        uri = manifest_build.table_uri(source, None, manifest_build.OCT_MANIFEST_AT, "manifest.tsv", "OCT_MANIFEST")
    except DataError:  # no manifest: the layout rule alone
        return {}
    try:
        rows = aireadi.parse_oct_manifest(fsio.read_text(uri), where=uri)
    except DataError as exc:
        print(f"expand: warning: {exc}; members are written by the layout rule alone", file=sys.stderr)
        return {}
    wanted = []
    for p in rows["filepath"]:
        try:
            wanted.append(fsio.safe_relpath(p, required_prefix=manifest_build.OCT_DIR))
        except fsio.PathEscapeError:
            continue
    matcher = manifest_build.Matcher({m.relpath: {} for m in members})
    matcher.claim_paths(wanted)
    out = {}
    for rel in wanted:
        found, how, _ = matcher.find(rel)
        if how == "name":
            out[found] = rel
    return out


def expand(source: str, dst: str, workers: int = 4, progress: bool = True) -> dict:
    check_roots(source, dst)
    t0 = time.perf_counter()
    tree = file_sizes(source)
    if not tree:
        raise cli.UsageError(f"SOURCE={source}: no files found")
    zips = sorted(r for r in tree if archives.is_archive(r))
    plain = {r: s for r, s in tree.items() if not archives.is_archive(r) and os.path.basename(r) != MIRROR_RECORD}
    listed = archives.list_archives(source, zips)
    results: list[dict] = []
    seen = dict.fromkeys(plain, "a plain file")
    jobs = {}
    for rel, (members, error) in listed.items():
        if error:
            results.append({"path": rel, "status": "failed", "error": error, "bytes": 0, "archive": True})
            continue
        keep, dups = archives.first_source_wins(members, rel, seen)
        results += [{"path": m.relpath, "status": "failed", "bytes": 0,
                     "error": f"duplicate: {rel} holds a path already in {holder}"} for m, holder in dups]
        jobs[rel] = keep
    moved = {m: rel for m, rel in manifest_paths(source, [m for ms in jobs.values() for m in ms]).items()
             if rel not in seen}  # never onto a path a plain file or another member already writes
    jobs = {rel: [dataclasses.replace(m, relpath=moved.get(m.relpath, m.relpath)) for m in ms]
            for rel, ms in jobs.items()}
    fsio.remove_stale_temps(dst, recursive=True)  # temp files of a run killed mid-write
    existing = file_sizes(dst)
    total = sum(m.size for ms in jobs.values() for m in ms) + sum(plain.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="expand", disable=not progress, file=sys.stderr)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(expand_archive, source, dst, rel, ms, existing, bar.update) for rel, ms in jobs.items()]
        futures += [pool.submit(copy_plain, source, dst, rel, size, existing, bar.update) for rel, size in plain.items()]
        for fut in futures:
            results += fut.result()
    bar.close()
    return {"results": results, "archives": len(zips), "members": sum(len(m) for m, _ in listed.values()),
            "plain": len(plain), "moved": len(moved), "seconds": time.perf_counter() - t0}


def summarize(s: dict, source: str, dst: str) -> str:
    res = s["results"]
    status = Counter(r["status"] for r in res if not r.get("archive"))
    bad_archives = [r for r in res if r.get("archive")]
    copied_mb = sum(r["bytes"] for r in res) / 1e6
    lines = [f"expand: {source} -> {dst}: {s['archives']} archive(s) with {s['members']} member(s), "
             f"{s['plain']} other file(s); {s['moved']} member(s) written at the path manifest.tsv lists (found by "
             "file name)",
             f"expand: copied {status['copied']} ({copied_mb:.1f} MB, size and CRC-32 verified), "
             f"skipped {status['skipped']} (already there with the same size and CRC-32), failed {status['failed']}"
             f"{f', {len(bad_archives)} unreadable archive(s)' if bad_archives else ''}; {s['seconds']:.1f}s"]
    for r in bad_archives:
        lines.append(f"unreadable archive, none of its members written: {r['error']}")
    failed = [r for r in res if r["status"] == "failed" and not r.get("archive")]
    if failed:
        reasons = Counter(cli.reason(r["error"]) for r in failed)
        lines.append(cli.format_table(["failure reason", "files"], reasons.most_common()))
        lines += [f"failed: {r['path']}: {r['error']}" for r in failed[:20]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make expand", description=__doc__)
    ap.add_argument("--source", required=True, help="dataset root holding ZIP archives (local folder or gs://)")
    ap.add_argument("--dst", required=True, help="where the plain tree goes (local folder or gs://)")
    ap.add_argument("--workers", type=int, default=4, help="archives expanded at once")
    ap.add_argument("--strict", action="store_true", help="exit 3 when any file or archive failed")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    s = expand(a.source, a.dst, a.workers, progress=not a.no_progress)
    print(summarize(s, a.source, a.dst))
    return cli.strict_status(sum(r["status"] == "failed" for r in s["results"]), a.strict)


if __name__ == "__main__":
    cli.run(main)
