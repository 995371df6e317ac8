"""`make cache`: decode, validate, normalise and store every source DICOM as a Zarr volume.

Resumable: a volume whose cache key (source identity, output-affecting parameters, code
version) is unchanged is reused; everything else is (re)done. The manifest part is
rewritten atomically while running (pending rows marked) and at the end. One bad file
becomes a failed row; a crashed worker is retried once, then its row fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
import zlib
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Sequence

from tqdm import tqdm

from cache import store
from ingest import preprocess as prep
from ingest.dicom import BadInput, read_volume
from manifests import build as manifest_build
from manifests import schema
from octfm import cli, config, fsio

SOURCE_NAMES = [f.name for f in schema.SOURCE_FIELDS]
VOLUME_NAMES = [f.name for f in schema.CACHE_FIELDS if f.name not in SOURCE_NAMES]
OUTPUT_KEYS = ("target_shape", "percentiles", "window_samples", "orientation")


@dataclasses.dataclass
class CacheConfig:
    preprocess: prep.PreprocessConfig = dataclasses.field(default_factory=prep.PreprocessConfig)
    workers: int = 0
    codec: str = "zstd"
    clevel: int = 3
    flush_every_s: float = 30.0
    read_retries: int = 4


def parse_shard(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 1
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise cli.UsageError(f"SHARD={text!r}: expected i/N such as 0/4") from None
    if not (n >= 1 and 0 <= i < n):
        raise cli.UsageError(f"SHARD={text!r}: need 0 <= i < N")
    return i, n


def in_shard(relpath: str, shard: tuple[int, int]) -> bool:
    """Deterministic and stable when files are added: a hash of the path, not its rank."""
    return zlib.crc32(relpath.encode()) % shard[1] == shard[0]


def volume_path(relpath: str) -> str:
    rel = relpath.removeprefix(manifest_build.OCT_DIR + "/")
    return "volumes/" + (rel[:-4] if rel.lower().endswith(".dcm") else rel) + ".zarr"


def cache_key(row: dict, cfg: CacheConfig) -> str:
    p = config.to_dict(cfg.preprocess)
    ident = {
        "relpath": row["relpath"], "size": row.get("size"), "version": row.get("source_version"),
        "sha1": row.get("expected_sha1"), "md5": row.get("expected_md5"),
        "params": {k: p[k] for k in OUTPUT_KEYS}, "code": prep.CODE_VERSION,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


# ---------------------------------------------------------------- worker side

def _init_worker() -> None:
    """One thread per worker: the pool, not the libraries, uses the cores."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    import torch
    torch.set_num_threads(1)
    try:
        import numcodecs.blosc
        numcodecs.blosc.use_threads = False
    except ImportError:
        pass


def read_with_retries(uri: str, attempts: int) -> bytes:
    """Read a source, retrying transient I/O errors with exponential backoff."""
    delay = 0.5
    for attempt in range(1, attempts + 1):
        try:
            return fsio.read_bytes(uri)
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            raise
        except OSError:
            if attempt == attempts:
                raise
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def process_row(row: dict, cfg_dict: dict, cache_root: str, tag: str) -> dict:
    """One source -> one cache row (ok or failed). Never raises for bad input."""
    cfg = config.from_dict(CacheConfig, cfg_dict)
    t0 = time.perf_counter()
    out = {"status": "failed", "volume": None, "cache_key": row["cache_key"], "code_version": prep.CODE_VERSION}
    try:
        try:
            data = read_with_retries(row["source"], cfg.read_retries)
        except FileNotFoundError:
            raise BadInput("missing: the file disappeared after the listing") from None
        except PermissionError as exc:
            raise BadInput(f"unreadable: permission denied ({exc.strerror or exc})") from None
        except OSError as exc:
            raise BadInput(f"read error after {cfg.read_retries} attempts: {type(exc).__name__}: {exc}") from None
        if row.get("size") is not None and len(data) != row["size"]:
            raise BadInput(f"size mismatch: read {len(data)} bytes, the listing said {row['size']}")
        out["sha1"] = hashlib.sha1(data).hexdigest()
        if row.get("expected_sha1") and out["sha1"] != row["expected_sha1"]:
            raise BadInput(f"checksum mismatch: SHA-1 {out['sha1']} differs from the mirror record {row['expected_sha1']}")
        if row.get("expected_md5"):
            md5 = hashlib.md5(data).hexdigest()
            if md5 != row["expected_md5"]:
                raise BadInput(f"checksum mismatch: MD5 {md5} differs from the mirror record {row['expected_md5']}")
        t1 = time.perf_counter()
        vol = read_volume(data, max_voxels=cfg.preprocess.max_voxels, decoder=cfg.preprocess.decoder,
                          accept_any_sop=cfg.preprocess.accept_any_sop)
        del data
        t2 = time.perf_counter()
        protocol = " ".join(str(v or "") for v in (row.get("imaging"), row.get("anatomic_region"),
                                                    os.path.basename(row["relpath"])))
        flip = prep.flip_axes(row.get("device"), protocol, cfg.preprocess.orientation)
        arr, lo, hi = prep.preprocess(vol.pixels, cfg.preprocess, flip)
        t3 = time.perf_counter()
        out.update({
            "status": "ok", "error": None, "volume": volume_path(row["relpath"]),
            "shape": list(arr.shape), "native_shape": list(vol.pixels.shape), "lo": lo, "hi": hi,
            "spacing_mm": prep.output_spacing(vol.spacing_mm, vol.pixels.shape, arr.shape),
            "native_spacing_mm": list(vol.spacing_mm) if vol.spacing_mm else None,
            "flipped_axes": flip, "transfer_syntax": vol.transfer_syntax, "bits_stored": vol.bits_stored,
            "decode_s": round(t2 - t1, 4), "preprocess_s": round(t3 - t2, 4),
        })
        out["total_s"] = round(time.perf_counter() - t0, 4)
        store.write_volume(cache_root, out["volume"], arr, {k: out.get(k) for k in VOLUME_NAMES},
                           cname=cfg.codec, clevel=cfg.clevel, tag=tag)
    except BadInput as exc:
        out.update(status="failed", error=str(exc), volume=None)
    except MemoryError:
        out.update(status="failed", error="out of memory while processing this volume", volume=None)
    except Exception as exc:  # noqa: BLE001 - one bad file never stops the batch
        out.update(status="failed", error=f"internal error: {type(exc).__name__}: {exc}", volume=None)
    out.setdefault("total_s", round(time.perf_counter() - t0, 4))
    return out


# ---------------------------------------------------------------- driver side

def load_sources(source: str, cache_root: str, seed: int = 0) -> list[dict]:
    """<CACHE>/sources.parquet, built from SOURCE when missing or made for another root."""
    uri = fsio.join(cache_root, "sources.parquet")
    root = source.rstrip("/")
    if fsio.exists(uri):
        rows = schema.read_table(uri, schema.SOURCES_SCHEMA).to_pylist()
        if all((r["source"] or "").startswith(root + "/") or r["source"] is None for r in rows) and rows:
            return rows
        print(f"cache: {uri} was made for another SOURCE; rebuilding it from {source}")
    rows, summary = manifest_build.build_sources(source, seed=seed)
    manifest_build.write_sources(rows, uri)
    print(f"cache: wrote {uri} ({len(rows)} rows)")
    return rows


def part_uri(cache_root: str, shard: tuple[int, int]) -> str:
    return fsio.join(cache_root, "manifest.parquet", f"part-{shard[0]:04d}-of-{shard[1]:04d}.parquet")


def previous_rows(cache_root: str, shard: tuple[int, int]) -> dict[str, dict]:
    uri = part_uri(cache_root, shard)
    if not fsio.exists(uri):
        return {}
    try:
        rows = schema.read_table(uri, schema.CACHE_SCHEMA).to_pylist()
    except Exception:  # noqa: BLE001 - an unreadable old part only costs a recheck
        return {}
    return {r["relpath"]: r for r in rows}


def existing_arrays(cache_root: str) -> set[str]:
    """Volume paths (relative) that have array metadata, from one listing."""
    fs, base = fsio.filesystem(fsio.join(cache_root, "volumes"))
    if not fs.exists(base):
        return set()
    prefix = fs._strip_protocol(fsio.join(cache_root, "")).rstrip("/") + "/"
    return {p[len(prefix):].removesuffix("/zarr.json") for p in fs.find(base) if p.endswith(".zarr/zarr.json")}


def plan(rows: list[dict], cfg: CacheConfig, cache_root: str, shard: tuple[int, int]):
    """Split this shard's rows into reusable (done) and to-do, computing cache keys."""
    prev = previous_rows(cache_root, shard)
    arrays = existing_arrays(cache_root)
    done, todo = [], []
    for src in rows:
        row = {k: src.get(k) for k in SOURCE_NAMES}
        row["cache_key"] = cache_key(row, cfg)
        if row["manifest_error"]:
            done.append({**row, "status": "failed", "error": row["manifest_error"], "code_version": prep.CODE_VERSION})
            continue
        vol = volume_path(row["relpath"])
        if vol in arrays:
            old = prev.get(row["relpath"])
            if not (old and old.get("status") == "ok" and old.get("cache_key") == row["cache_key"]):
                old = store.read_attrs(cache_root, vol)
            if old and old.get("cache_key") == row["cache_key"] and old.get("status") == "ok":
                done.append({**{k: old.get(k) for k in VOLUME_NAMES}, **row, "reused": True})
                continue
        todo.append(row)
    return done, todo


def run_pool(todo: list[dict], cfg: CacheConfig, cache_root: str, tag: str, on_row) -> None:
    """Process rows in a spawn/forkserver pool; rows of a crashed worker get one retry."""
    workers = cfg.workers or len(os.sched_getaffinity(0))
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    cfg_dict = config.to_dict(cfg)
    attempts: Counter = Counter()
    pending = list(todo)
    while pending:
        retry: list[dict] = []
        with ProcessPoolExecutor(max_workers=min(workers, len(pending)), mp_context=ctx,
                                 initializer=_init_worker, max_tasks_per_child=64) as pool:
            futures = {pool.submit(process_row, r, cfg_dict, cache_root, tag): r for r in pending}
            remaining = set(futures)
            while remaining:
                finished, remaining = wait(remaining, timeout=5, return_when=FIRST_COMPLETED)
                for fut in finished:
                    row = futures[fut]
                    try:
                        on_row({**row, **fut.result()})
                    except BrokenProcessPool:
                        attempts[row["relpath"]] += 1
                        if attempts[row["relpath"]] >= 2:
                            on_row({**row, "status": "failed", "error": "worker crashed: the process died while "
                                    "decoding this file twice (out of memory or a decoder crash)"})
                        else:
                            retry.append(row)
                on_row(None)  # a tick, so the driver can flush on time
        pending = retry


def write_part(rows_by_path: dict, pending: dict, cache_root: str, shard) -> None:
    rows = list(rows_by_path.values()) + [{**r, "status": "pending"} for r in pending.values()]
    rows.sort(key=lambda r: r["relpath"])
    fsio.write_parquet_atomic(schema.to_table(rows, schema.CACHE_SCHEMA), part_uri(cache_root, shard))


def tidy_manifest_dir(cache_root: str, shard: tuple[int, int]) -> None:
    """Drop parts written with another N (superseded by this sharding) and this part's
    temp files from a killed run."""
    fs, base = fsio.filesystem(fsio.join(cache_root, "manifest.parquet"))
    if not fs.isdir(base):
        if fs.exists(base):
            fs.rm(base)
        return
    mine = os.path.basename(part_uri(cache_root, shard))
    for p in fs.ls(base, detail=False):
        name = os.path.basename(p)
        if (name.startswith("part-") and not name.endswith(f"-of-{shard[1]:04d}.parquet")) or \
                name.startswith(f".{mine}.tmp-"):
            fs.rm(p)


def summarize(rows: list[dict], reused: int, seconds: float, cache_root: str, shard) -> str:
    per_dev: dict = {}
    for r in rows:
        d = per_dev.setdefault(r.get("device") or "unknown", Counter())
        d[r["status"]] += 1
    table = cli.format_table(["device", "ok", "failed"],
                             [(d, c["ok"], c["failed"]) for d, c in sorted(per_dev.items())] +
                             [("total", sum(c["ok"] for c in per_dev.values()),
                               sum(c["failed"] for c in per_dev.values()))])
    reasons = Counter(r["error"].split(":")[0] for r in rows if r["status"] == "failed" and r.get("error"))
    lines = [table]
    if reasons:
        lines.append(cli.format_table(["failure reason", "files"], reasons.most_common()))
    new = len(rows) - reused
    lines.append(f"cache: {len(rows)} rows in shard {shard[0]}/{shard[1]}: {reused} reused, {new} processed in "
                 f"{seconds:.1f}s; wrote {part_uri(cache_root, shard)}")
    return "\n".join(lines)


def build(source: str, cache_root: str, cfg: CacheConfig, shard=(0, 1), progress: bool = True) -> list[dict]:
    """Build (or complete) this shard of the cache. Returns its manifest rows."""
    t0 = time.perf_counter()
    tag = f"s{shard[0]}"
    store.remove_stale_temps(cache_root, tag)
    rows = [r for r in load_sources(source, cache_root) if in_shard(r["relpath"], shard)]
    done, todo = plan(rows, cfg, cache_root, shard)
    reused = sum(1 for r in done if r.pop("reused", False))
    tidy_manifest_dir(cache_root, shard)
    by_path = {r["relpath"]: r for r in done}
    pending = {r["relpath"]: r for r in todo}
    bar = tqdm(total=len(todo), desc="cache", unit="vol", disable=not progress or not todo, file=sys.stderr)
    last_flush = time.monotonic()

    def on_row(row: dict | None) -> None:
        nonlocal last_flush
        if row is not None:
            row = {k: row.get(k) for k in schema.CACHE_SCHEMA.names}
            by_path[row["relpath"]] = row
            pending.pop(row["relpath"], None)
            bar.update(1)
            bar.set_postfix(failed=sum(r["status"] == "failed" for r in by_path.values()), refresh=False)
        if time.monotonic() - last_flush > cfg.flush_every_s:
            write_part(by_path, pending, cache_root, shard)
            last_flush = time.monotonic()

    if todo:
        write_part(by_path, pending, cache_root, shard)
        run_pool(todo, cfg, cache_root, tag, on_row)
    bar.close()
    write_part(by_path, {}, cache_root, shard)
    out = sorted(by_path.values(), key=lambda r: r["relpath"])
    print(summarize(out, reused, time.perf_counter() - t0, cache_root, shard))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make cache", description=__doc__)
    ap.add_argument("--source", required=True, help="dataset root (local folder or gs://...)")
    ap.add_argument("--cache", required=True, help="cache root (local folder or gs://...)")
    ap.add_argument("--config", default=None, help="YAML (configs/cache.yaml)")
    ap.add_argument("--shard", default=None, help="i/N: this machine's share")
    ap.add_argument("--strict", action="store_true", help="exit 3 when any row failed")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    cfg = config.load(CacheConfig, args.config, args.overrides)
    shard = parse_shard(args.shard)
    rows = build(args.source, args.cache, cfg, shard, progress=not args.no_progress)
    return cli.strict_status(sum(r["status"] == "failed" for r in rows), args.strict)


if __name__ == "__main__":
    cli.run(main)
