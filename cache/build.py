"""`make cache`: decode, validate, normalise and store every source DICOM as a Zarr volume.

Resumable: a volume whose cache key (source identity, output-affecting parameters, code
version) is unchanged is reused; everything else is (re)done. The manifest part is
rewritten atomically while running (pending rows marked) and at the end. One bad file
becomes a failed row; a crashed worker is retried once, then its row fails.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from cache import shards, store
from cache.config import CacheConfig
from cache.worker import SCAN_NAMES, SOURCE_NAMES, VOLUME_NAMES, _init_worker, process_row, volume_path
from ingest import dicom
from ingest import preprocess as prep
from ingest import scan as scans
from manifests import build as manifest_build
from manifests import paths, schema
from octfm import cli, config, fsio, procs

# the preprocess keys a volume's bytes depend on (the decoder too: another one can change lossy pixels)
OUTPUT_KEYS = ("target_shape", "resample", "spacing_mm", "geometry", "percentiles", "window_samples", "orientation",
               "decoder")


def cache_key(row: dict, cfg: CacheConfig) -> str:
    p = config.to_dict(cfg.preprocess)
    if p["decoder"] == "auto":  # which plugin "auto" picks is part of what decoded the pixels
        p["decoder"] = "auto:" + ",".join(dicom.DECODER_ORDER)
    ident = {
        "relpath": row["relpath"], "size": row.get("size"), "version": row.get("source_version"),
        "sha1": row.get("expected_sha1"), "md5": row.get("expected_md5"),
        "params": {k: p[k] for k in OUTPUT_KEYS if not (k == "spacing_mm" and p["resample"] == "grid")},
        "code": prep.CODE_VERSION,
    }
    return config.content_key(ident, 20)


# ---------------------------------------------------------------- driver side

def source_location(uri: str) -> str:
    """Where a source lives: the archive for a ZIP member URI, else the URI itself."""
    member = fsio.split_member_uri(uri)
    return member[0] if member else uri


def load_sources(source: str, cache_root: str, seed: int = 0, tables: dict | None = None,
                 shards: int = 1) -> list[dict]:
    """The source rows as SOURCE holds them now: the dataset listed again (one listing, with the
    options `make manifest` recorded in <CACHE>/sources.parquet) and that file rewritten when
    what it lists changed (files added, removed or rewritten, a relabelled participants.tsv) or
    it was made for another root. Keyed on the listing, not the path: a tree regenerated in the
    same folder is read anew. `tables`: oct_manifest / participants_tsv given on the command line.
    One shard of several (`shards` > 1) keeps the stored file whatever the listing says now: every
    host must split the same rows, and a bucket that changed between two hosts' starts would
    otherwise give some files to two shards and others to none; it warns instead, naming the fix."""
    uri = paths.sources_uri(cache_root)
    stored = paths.read_sources(cache_root)
    opts = manifest_build.sources_options(source, seed)
    same_root = stored is not None and _made_for(stored, opts["root"])
    if same_root:
        opts.update({k: v for k, v in stored[1].items() if k in ("seed", "oct_manifest", "participants_tsv")})
    opts.update({k: v for k, v in (tables or {}).items() if v})
    rows, _ = manifest_build.build_sources(**opts)
    if same_root:
        change = _changes(stored[0], rows)
        if not change:
            return stored[0]
        if shards > 1:
            print(f"cache: warning: SOURCE={source} changed since {uri} was written ({change}); this shard keeps "
                  "it, so every shard splits the same rows. To cache the change: `make manifest`, then every shard "
                  "again", file=sys.stderr)
            return stored[0]
        print(f"cache: SOURCE={source} changed since {uri} was written ({change}); rewriting it")
    elif stored is not None:
        print(f"cache: {uri} was made for another SOURCE; rebuilding it from {source}")
    manifest_build.write_sources(rows, uri, opts)
    print(f"cache: wrote {uri} ({len(rows)} rows)")
    return rows


def _made_for(stored: tuple[list[dict], dict], root: str) -> bool:
    rows, opts = stored
    if "root" in opts:
        return opts["root"] == root
    return all(r["source"] is None or source_location(r["source"]).startswith(root + "/") for r in rows)


def _changes(old: list[dict], new: list[dict]) -> str:
    """'' when the two listings' rows are the same, else what changed, in counts."""
    if schema.to_table(old, schema.SOURCES_SCHEMA).equals(schema.to_table(new, schema.SOURCES_SCHEMA)):
        return ""
    a = {r["relpath"]: r for r in old}
    b = {r["relpath"]: r for r in new}
    changed = sum(a[k] != b[k] for k in a.keys() & b.keys())
    return f"{len(b.keys() - a.keys())} rows added, {len(a.keys() - b.keys())} removed, {changed} changed"


part_uri = paths.part_uri


def previous_rows(cache_root: str, shard: tuple[int, int]) -> dict[str, dict]:
    try:
        table = paths.read_part(cache_root, shard)
    except Exception:  # noqa: BLE001 - an unreadable old part only costs a recheck
        return {}
    return {r["relpath"]: r for r in table.to_pylist()} if table is not None else {}


def existing_arrays(cache_root: str) -> set[str]:
    """Volume paths (relative) whose OME-Zarr group metadata exists, from one listing."""
    fs, base = fsio.filesystem(paths.volumes_uri(cache_root))
    if not fs.exists(base):
        return set()
    prefix = fsio.filesystem(cache_root)[1].rstrip("/") + "/"
    return {p[len(prefix):].removesuffix("/zarr.json") for p in fs.find(base) if p.endswith(".zarr/zarr.json")}


def plan(rows: list[dict], cfg: CacheConfig, cache_root: str, shard: tuple[int, int]):
    """Split this shard's rows into done (failed in the manifest, not selected, or reusable) and
    to-do, computing cache keys. A file read before keeps its header's reading of the scan while the
    code that reads headers is unchanged (its reading_key); after a change it is read again, and its
    volume kept when the new reading is the same (the worker compares scan keys)."""
    prev = previous_rows(cache_root, shard)
    arrays = existing_arrays(cache_root)
    reading = scans.reading_key()
    done, todo = [], []
    for src in rows:
        row = {k: src.get(k) for k in SOURCE_NAMES}
        row["cache_key"] = cache_key(row, cfg)
        row["reading_key"] = reading
        if row["manifest_error"]:
            done.append({**row, "status": "failed", "error": row["manifest_error"], "code_version": prep.CODE_VERSION})
            continue
        old = prev.get(row["relpath"])
        same = old and old.get("cache_key") == row["cache_key"] and old.get("status") in ("ok", "skipped")
        read = old if same and old.get("native_shape") is not None and old.get("reading_key") == reading else None
        if read:
            row.update({k: read.get(k) for k in SCAN_NAMES})
        reason = cfg.select.skip_reason(row, final=bool(read))
        if reason is not None:
            kept = {k: read.get(k) for k in ("native_shape", "transfer_syntax", "sha1")} if read else {}
            done.append({**row, **kept, "status": "skipped", "skip_reason": reason, "code_version": prep.CODE_VERSION,
                         "reused": bool(same)})  # decided again without work: as before
            continue
        vol = volume_path(row["relpath"])
        if vol in arrays:
            if not (read and read.get("status") == "ok"):
                read = store.read_attrs(cache_root, vol)
            if read and read.get("cache_key") == row["cache_key"] and read.get("status") == "ok":
                if read.get("reading_key") == reading:
                    done.append({**row, **{k: read.get(k) for k in (*VOLUME_NAMES, *SCAN_NAMES) if k in read},
                                 "reused": True, "sop_instance_uid": row["sop_instance_uid"] or read.get("sop_instance_uid")})
                    continue
                row["prior_scan_key"] = read.get("scan_key")
        todo.append(row)
    return done, todo


WORKER_IMPORTS = ("torch", "cache.worker")  # what a worker imports (the resize is torch's): its server preloads them
WORKER_CRASHED = ("worker crashed: the process died while decoding this file alone (out of memory or a "
                  "decoder crash)")


def run_pool(todo: list[dict], cfg: CacheConfig, cache_root: str, tag: str, on_row) -> None:
    """Process rows in a pool of single-threaded workers, a few rows per worker submitted at
    a time so the driver's memory does not grow with the number of files. When a worker
    dies, every row in flight is a suspect: each is tried again alone, so a file that kills
    its worker fails by itself and the rows that were merely beside it are cached. No
    max_tasks_per_child: on Python 3.11 a pool that replaces its workers can hang forever
    (seen here at 128 tasks with 2 workers)."""
    workers = cfg.workers or len(os.sched_getaffinity(0))
    ctx = procs.worker_context(preload=WORKER_IMPORTS)
    cfg_dict = config.to_dict(cfg)
    queue = deque(todo)
    while queue:
        suspects = _run_round(queue, min(workers, len(queue)), 4 * workers, ctx, cfg_dict, cache_root, tag, on_row)
        if suspects:
            print(f"cache: a worker died (out of memory or a decoder crash?); trying its {len(suspects)} row(s) "
                  "again one at a time", file=sys.stderr)
        for row in suspects:
            if _run_round(deque([row]), 1, 1, ctx, cfg_dict, cache_root, tag, on_row):
                on_row({**row, "status": "failed", "error": WORKER_CRASHED})


def _run_round(queue: deque, workers: int, window: int, ctx, cfg_dict, cache_root, tag, on_row) -> list[dict]:
    """Feed rows from `queue` to one pool until the queue is empty or a worker dies; returns
    the rows that were in flight when it died (unsent rows stay queued)."""
    suspects: list[dict] = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker) as pool:
        futures: dict = {}

        def top_up() -> None:
            while queue and not suspects and len(futures) < window:
                row = queue.popleft()
                try:
                    futures[pool.submit(process_row, row, cfg_dict, cache_root, tag)] = row
                except BrokenProcessPool:
                    queue.appendleft(row)
                    return

        try:
            top_up()
            while futures:
                finished, _ = wait(list(futures), timeout=5, return_when=FIRST_COMPLETED)
                for fut in finished:
                    row = futures.pop(fut)
                    try:
                        result = fut.result()
                    except BrokenProcessPool:
                        suspects.append(row)
                        continue
                    on_row({**row, **result})
                top_up()
                on_row(None)  # a tick, so the driver can flush on time
        except cli.JobAborted:
            # stop now: rows still running would each take up to read_retries x read_timeout_s; they stay pending
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.kill()
            pool.shutdown(wait=True, cancel_futures=True)
            for fut, row in futures.items():
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    on_row({**row, **fut.result()})
            raise
    return suspects


def fail_duplicate_uids(rows: list[dict]) -> list[dict]:
    """Headers can reveal duplicates manifest.tsv could not (unlisted files): the first path
    keeps the image, later ones fail (in the rows returned; the inputs are not changed).
    Their arrays stay on disk, unreferenced, so a re-run reuses them and reaches the same
    verdict. Within one shard: duplicates in different shards fail when the parts are read
    together (manifests/paths.read_manifest_table)."""
    dups = paths.duplicate_uids(r for r in rows if r["status"] == "ok")
    return [{**r, "status": "failed", "volume": None,
             "error": f"duplicate SOP instance UID: {r['sop_instance_uid']} is also {dups[r['relpath']]}"}
            if r["relpath"] in dups else r for r in rows]


def write_part(rows_by_path: dict, pending: dict, cache_root: str, shard) -> list[dict]:
    """Write this shard's manifest part (every write, periodic ones included, with duplicate
    UIDs already failed); returns the rows written."""
    rows = fail_duplicate_uids(list(rows_by_path.values()))
    rows += [{**r, "status": "pending"} for r in pending.values()]
    rows.sort(key=lambda r: r["relpath"])
    uri = part_uri(cache_root, shard)
    try:
        fsio.write_parquet_atomic(schema.to_table(rows, schema.CACHE_SCHEMA), uri)
    except OSError as exc:
        if not fsio.is_disk_full(exc):
            raise
        raise cli.JobAborted(f"disk full: cannot write the manifest part {uri} ({exc.strerror}). The previous "
                             "part and every finished volume are intact: free space and re-run `make cache`.") from None
    return rows


class AbortRule:
    """Stop a build that can only fail from here on: at the first full disk, or after
    `limit` consecutive rows whose source could not be read even with retries (the store
    has gone away). Bad files do not count: they fail one at a time, mixed with good ones."""

    def __init__(self, limit: int, cache_root: str):
        self.limit, self.cache_root, self.streak, self.fired = limit, cache_root, 0, False

    def check(self, row: dict) -> None:
        """Raise JobAborted once; rows that finish while the job stops are only recorded."""
        if self.fired:
            return
        reason = cli.reason(row.get("error")) if row["status"] == "failed" else ""
        self.streak = self.streak + 1 if reason == "read error" else 0
        self.fired = reason == "disk full" or bool(self.limit and self.streak >= self.limit)
        if reason == "disk full":
            raise cli.JobAborted(f"disk full under {self.cache_root} (while writing {row['relpath']}). Finished "
                                 "volumes are kept and the manifest lists the rest as pending or failed: free "
                                 "space and re-run `make cache`; it does only what is left.")
        if self.limit and self.streak >= self.limit:
            raise cli.JobAborted(f"{self.streak} sources in a row could not be read even with retries (last: "
                                 f"{row['source']}: {row['error']}). The object store looks unreachable. Finished "
                                 "volumes are kept; re-run `make cache` when it is back (config key "
                                 "abort_after_read_errors sets this limit).")


def tidy_manifest_dir(cache_root: str, shard: tuple[int, int]) -> None:
    """Drop parts written with another N (superseded by this sharding) and this part's
    temp files from a killed run."""
    fs, base = fsio.filesystem(paths.manifest_uri(cache_root))
    if not fs.isdir(base):
        if fs.exists(base):
            fs.rm(base)
        return
    mine = paths.part_name(shard)
    for p in fs.ls(base, detail=False):
        name = os.path.basename(p)
        if (name.startswith("part-") and not name.endswith(f"-of-{shard[1]:04d}.parquet")) or \
                name.startswith(f".{mine}.tmp-"):
            fs.rm(p)


def summarize(rows: list[dict], reused: int, seconds: float, cache_root: str, shard, pending: int = 0,
              mismatches: int = 0) -> str:
    """The end-of-build table: volumes per device and protocol, then why rows failed or were skipped."""
    per: dict = {}
    for r in rows:
        per.setdefault((r.get("device") or "unknown", r.get("protocol") or "unknown"), Counter())[r["status"]] += 1
    statuses = ("ok", "skipped", "failed")
    totals = [sum(c[k] for c in per.values()) for k in statuses]
    table = cli.format_table(["device", "protocol", *statuses],
                             [(d, p, *(c[k] for k in statuses)) for (d, p), c in sorted(per.items())] +
                             [("total", "", *totals)])
    lines = [table]
    skips = Counter(r["skip_reason"] for r in rows if r["status"] == "skipped" and r.get("skip_reason"))
    if skips:
        lines.append(cli.format_table(["skipped because", "files"], skips.most_common()))
    reasons = Counter(cli.reason(r["error"]) for r in rows if r["status"] == "failed" and r.get("error"))
    if reasons:
        lines.append(cli.format_table(["failure reason", "files"], reasons.most_common()))
    read = [r for r in rows if r.get("native_shape") is not None]   # rows whose header was read
    if read:
        by = Counter(r.get("protocol_by") or "nothing" for r in read)
        lines.append("protocol told by: " + ", ".join(f"{k} {by[k]}" for k in ("header", "name", "shape", "nothing")
                                                        if by[k]) + " (ingest/scan.py)")
    warned = Counter(r.get("protocol") or "unknown" for r in rows if r.get("geometry_warning"))
    if warned:
        lines.append(cli.format_table(["geometry warnings", "files"], warned.most_common()))
        example = next(r for r in rows if r.get("geometry_warning"))
        lines.append(f"  e.g. {example['relpath']}: {example['geometry_warning']}")
    if mismatches:
        lines.append(f"note: {mismatches} file(s) whose name names another protocol than their header's "
                     "Protocol Name (the header's is kept)")
    new = len(rows) - reused
    left = f", {pending} pending (not started; a re-run does them)" if pending else ""
    lines.append(f"cache: {len(rows) + pending} rows in shard {shard[0]}/{shard[1]}: {reused} reused, {new} processed"
                 f"{left} in {seconds:.1f}s; wrote {part_uri(cache_root, shard)}")
    return "\n".join(lines)


def build(source: str, cache_root: str, cfg: CacheConfig, shard=(0, 1), progress: bool = True,
          tables: dict | None = None) -> list[dict]:
    """Build (or complete) this shard of the cache. Returns its manifest rows. A local cache
    takes one build per shard at a time (a lock file in its root): two builders of the same
    shard would write the same volumes and overwrite each other's manifest part."""
    if fsio.is_remote(cache_root):
        return _build(source, cache_root, cfg, shard, progress, tables)
    root = Path(fsio.filesystem(cache_root)[1])  # a plain path or file://
    root.mkdir(parents=True, exist_ok=True)
    lock = root / f".build-{shard[0]}-of-{shard[1]}.lock"
    try:
        with fsio.pid_lock(lock, on_stale=lambda m: print(f"cache: {m}", file=sys.stderr)):
            return _build(source, cache_root, cfg, shard, progress, tables)
    except fsio.Busy as exc:
        raise cli.UsageError(f"--cache {cache_root}: another make cache is building shard {shard[0]}/{shard[1]} of "
                             f"it ({exc}); wait for it to finish") from None


def _build(source: str, cache_root: str, cfg: CacheConfig, shard, progress: bool, tables: dict | None) -> list[dict]:
    t0 = time.perf_counter()
    tag = f"s{shard[0]}"
    fsio.remove_stale_temps(cache_root, recursive=True, tag=tag)  # this shard's, from a killed run
    sources = load_sources(source, cache_root, tables=tables, shards=shard[1])
    rows = shards.select(sources, shard)
    if shard[1] > 1:
        print(f"cache: shard {shard[0]}/{shard[1]}: {shards.balance_line(sources, shard)}")
    done, todo = plan(rows, cfg, cache_root, shard)
    reused = sum(1 for r in done if r.pop("reused", False))
    tidy_manifest_dir(cache_root, shard)
    by_path = {r["relpath"]: {k: r.get(k) for k in schema.CACHE_SCHEMA.names} for r in done}
    pending = {r["relpath"]: r for r in todo}
    bar = tqdm(total=len(todo), desc="cache", unit="vol", disable=not progress or not todo, file=sys.stderr)
    last_flush = time.monotonic()
    abort = AbortRule(cfg.abort_after_read_errors, cache_root)

    failed = sum(r["status"] == "failed" for r in by_path.values())
    mismatches = 0

    def on_row(row: dict | None) -> None:
        nonlocal last_flush, failed, mismatches
        if row is not None:
            mismatches += bool(row.get("protocol_mismatch"))
            row = {k: row.get(k) for k in schema.CACHE_SCHEMA.names}
            by_path[row["relpath"]] = row
            pending.pop(row["relpath"], None)
            failed += row["status"] == "failed"
            bar.update(1)
            bar.set_postfix(failed=failed, refresh=False)
            abort.check(row)
        if time.monotonic() - last_flush > cfg.flush_every_s:
            write_part(by_path, pending, cache_root, shard)
            last_flush = time.monotonic()

    if todo:
        write_part(by_path, pending, cache_root, shard)
        try:
            run_pool(todo, cfg, cache_root, tag, on_row)
        except cli.JobAborted:
            bar.close()
            written = write_part(by_path, pending, cache_root, shard)  # what finished is on record, the rest pending
            print(summarize([r for r in written if r["status"] != "pending"], reused,
                            time.perf_counter() - t0, cache_root, shard, pending=len(pending), mismatches=mismatches))
            raise
    bar.close()
    out = write_part(by_path, {}, cache_root, shard)
    print(summarize(out, reused, time.perf_counter() - t0, cache_root, shard, mismatches=mismatches))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make cache", description=__doc__)
    ap.add_argument("--source", required=True, help="dataset root (local folder or gs://...)")
    ap.add_argument("--cache", required=True, help="cache root (local folder or gs://...)")
    ap.add_argument("--config", default=None, help="YAML (configs/cache.yaml)")
    ap.add_argument("--shard", default=None, help="i/N: this machine's share (default: from the scheduler's "
                    "environment, see cache.shards)")
    ap.add_argument("--shards", type=int, default=None, help="N, with an index from the environment that comes "
                    "without a count (a Kubernetes Indexed Job's JOB_COMPLETION_INDEX)")
    ap.add_argument("--strict", action="store_true", help="exit 3 when any row failed (skipped rows do not count)")
    ap.add_argument("--oct-manifest", default=None, help="as make manifest's (make OCT_MANIFEST=...)")
    ap.add_argument("--participants", default=None, help="as make manifest's (make PARTICIPANTS=...)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    cfg = config.load(CacheConfig, args.config, args.overrides)
    shard = shards.resolve(args.shard, args.shards)
    print(f"cache: shard {shard}")
    rows = build(args.source, args.cache, cfg, (shard.index, shard.count), progress=not args.no_progress,
                 tables={"oct_manifest": args.oct_manifest, "participants_tsv": args.participants})
    return cli.strict_status(sum(r["status"] == "failed" for r in rows), args.strict)


if __name__ == "__main__":
    cli.run(main)
