"""The cache build's worker: one source DICOM in, one cached volume and manifest row out.

Kept apart from the driver (cache.build) so the pool's forkserver can preload it, with
torch, once; workers then start in milliseconds.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import time

from cache import store
from cache.config import CacheConfig
from ingest import preprocess as prep
from ingest import scan as scans
from ingest.dicom import BadInput, decode_pixels, read_header
from manifests import paths, schema
from octfm import archives, config, fsio

SOURCE_NAMES = [f.name for f in schema.SOURCE_FIELDS]
VOLUME_NAMES = [f.name for f in schema.CACHE_FIELDS if f.name not in SOURCE_NAMES]
# source columns the header reads anew (ingest/scan.py): a reused row keeps the header's reading
SCAN_NAMES = ("protocol", "protocol_by", "scan_pattern", "field_mm", "geometry_warning")


def volume_path(relpath: str) -> str:
    return paths.volume_relpath(relpath)


def _init_worker() -> None:
    """One thread per worker: the pool, not the libraries, uses the cores."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    import torch
    torch.set_num_threads(1)
    # gcsfs logs a traceback for every request that runs out of retries; the row's error says it once
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    try:
        import numcodecs.blosc
        numcodecs.blosc.use_threads = False
    except ImportError:
        pass


def scan_key(row: dict, scan) -> str:
    """What, besides the pixels, decides a volume's bytes: the row's cache key (the source and the
    output parameters) and the header's reading. A re-read (the reading code changed) that gives the
    same key keeps the volume without decoding it again."""
    return config.content_key({"cache_key": row["cache_key"], "shape": scan.native_shape, "pattern": scan.pattern,
                               "spacing": [None if math.isnan(v) else round(v, 9) for v in scan.spacing or ()],
                               "flips": scan.flips}, 20)


def _kept_volume(row: dict, key: str, cache_root: str) -> dict | None:
    """The cached volume's own record when it was made from this very reading (its scan key), else None."""
    if row.get("prior_scan_key") != key:
        return None
    attrs = store.read_attrs(cache_root, volume_path(row["relpath"]))
    if not attrs or attrs.get("scan_key") != key or attrs.get("status") != "ok":
        return None
    return {k: attrs.get(k) for k in VOLUME_NAMES if k in attrs and k not in ("reading_key", "total_s")}


def read_with_retries(uri: str, attempts: int, timeout: float | None = None) -> bytes:
    """Read a source, retrying transient I/O errors (timeouts included) with exponential backoff."""
    delay = 0.5
    for attempt in range(1, attempts + 1):
        try:
            return fsio.read_bytes(uri, timeout)
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            raise
        except OSError:
            if attempt == attempts:
                raise
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def read_source(row: dict, cfg: CacheConfig) -> bytes:
    """The source's bytes, or BadInput naming why they cannot be read."""
    try:
        return read_with_retries(row["source"], cfg.read_retries, cfg.read_timeout_s)
    except FileNotFoundError:
        raise BadInput("missing: the file disappeared after the listing") from None
    except PermissionError as exc:
        raise BadInput(f"unreadable: permission denied ({exc.strerror or exc})") from None
    except OSError as exc:
        detail = str(exc) or f"no answer within read_timeout_s={cfg.read_timeout_s:g}"
        raise BadInput(f"read error: {type(exc).__name__}: {detail} (after {cfg.read_retries} attempts)") from None
    except Exception as exc:  # a ZIP member: zipfile checks its CRC-32 as it reads
        reason = archives.read_failure(exc, row["source"])
        if reason is None:
            raise
        raise BadInput(reason) from None


def check_bytes(row: dict, data: bytes) -> str:
    """The bytes' SHA-1, after checking their size against the listing and their hashes against the
    mirror record (BadInput when they differ)."""
    if row.get("size") is not None and len(data) != row["size"]:
        raise BadInput(f"size mismatch: read {len(data)} bytes, the listing said {row['size']}")
    sha1 = hashlib.sha1(data).hexdigest()
    if row.get("expected_sha1") and sha1 != row["expected_sha1"]:
        raise BadInput(f"checksum mismatch: SHA-1 {sha1} differs from the mirror record {row['expected_sha1']}")
    if row.get("expected_md5"):
        md5 = hashlib.md5(data).hexdigest()
        if md5 != row["expected_md5"]:
            raise BadInput(f"checksum mismatch: MD5 {md5} differs from the mirror record {row['expected_md5']}")
    return sha1


def process_row(row: dict, cfg_dict: dict, cache_root: str, tag: str) -> dict:
    """One source -> one cache row: ok, skipped (the header shows it is not selected) or failed.
    Never raises for bad input."""
    cfg = config.from_dict(CacheConfig, cfg_dict)
    t0 = time.perf_counter()
    out = {"status": "failed", "volume": None, "cache_key": row["cache_key"], "code_version": prep.CODE_VERSION}
    try:
        data = read_source(row, cfg)
        out["sha1"] = check_bytes(row, data)
        t1 = time.perf_counter()
        header = read_header(data, max_voxels=cfg.preprocess.max_voxels, accept_any_sop=cfg.preprocess.accept_any_sop)
        scan = scans.describe(header, row, cfg.preprocess.geometry, cfg.preprocess.orientation)
        out.update(protocol=scan.protocol, protocol_by=scan.protocol_by, scan_pattern=scan.pattern,
                   field_mm=scan.field_mm, native_shape=scan.native_shape, geometry_warning=scan.geometry_warning,
                   transfer_syntax=str(header.ds.file_meta.TransferSyntaxUID), protocol_mismatch=scan.mismatch,
                   reading_key=row.get("reading_key") or scans.reading_key())
        reason = cfg.select.skip_reason({**row, **out})
        if reason is not None:  # decided by the header: no pixel decoded
            out.update(status="skipped", skip_reason=reason, error=None, volume=None,
                       total_s=round(time.perf_counter() - t0, 4))
            return out
        out["scan_key"] = scan_key(row, scan)
        kept = _kept_volume(row, out["scan_key"], cache_root)
        if kept:  # re-read after the reading code changed, and read the same: the volume stands
            return {**out, **kept, "total_s": round(time.perf_counter() - t0, 4)}
        vol = decode_pixels(header, data, cfg.preprocess.decoder)
        del data
        t2 = time.perf_counter()
        res = prep.preprocess(vol.pixels, cfg.preprocess, scan.flips, scan.spacing)
        arr = res.volume
        t3 = time.perf_counter()
        out.update({
            "status": "ok", "error": None, "volume": volume_path(row["relpath"]),
            "shape": list(arr.shape), "lo": res.lo, "hi": res.hi,
            "spacing_mm": res.spacing_mm, "crop_pad": res.crop_pad,
            "native_spacing_mm": [v if v > 0 else None for v in vol.spacing_mm] if vol.spacing_mm else None,
            "flipped_axes": scan.flips, "flipped": scan.flipped, "bits_stored": vol.bits_stored,
            "decode_s": round(t2 - t1, 4), "preprocess_s": round(t3 - t2, 4),
        })
        if not row.get("sop_instance_uid"):  # unlisted files: the header's UID, so duplicates show
            out["sop_instance_uid"] = vol.sop_instance_uid
        out["total_s"] = round(time.perf_counter() - t0, 4)
        attrs = {k: out.get(k) for k in (*VOLUME_NAMES, *SCAN_NAMES)} | {
            "sop_instance_uid": vol.sop_instance_uid, "preprocess": config.to_dict(cfg.preprocess)}
        store.write_volume(cache_root, out["volume"], arr, attrs,
                           cname=cfg.codec, clevel=cfg.clevel, tag=tag)
    except BadInput as exc:
        out.update(status="failed", error=str(exc), volume=None)
    except OSError as exc:
        if not fsio.is_disk_full(exc):
            out.update(status="failed", error=f"internal error: {type(exc).__name__}: {exc}", volume=None)
        else:
            out.update(status="failed", volume=None,
                       error=f"disk full: no space left writing under {cache_root} ({exc.strerror})")
    except MemoryError:
        out.update(status="failed", error="out of memory while processing this volume", volume=None)
    except Exception as exc:  # noqa: BLE001 - one bad file never stops the batch
        out.update(status="failed", error=f"internal error: {type(exc).__name__}: {exc}", volume=None)
    out.setdefault("total_s", round(time.perf_counter() - t0, 4))
    return out
