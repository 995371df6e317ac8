"""Where every file of the dataset side and of the cache lives, and how it is read: the one
owner of these paths (docs/architecture.md, "On-disk contracts"). Commands ask here instead of
joining strings.

Dataset root (SOURCE):   octfm_mirror.parquet (written by `make mirror`: relpath -> SHA-1/MD5)
Cache root (CACHE):      sources.parquet (`make manifest`), manifest.parquet/part-<i>-of-<N>.parquet
                         (`make cache`, one part per shard), volumes/<relpath without .dcm>.zarr
"""
from __future__ import annotations

import json
import posixpath
import sys
from collections import Counter

import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from manifests import schema
from octfm import fsio

OCT_DIR = "retinal_oct"                   # the dataset folder the manifest lists
MIRROR_RECORD = "octfm_mirror.parquet"
MIRROR_RECORD_SCHEMA = pa.schema([
    pa.field("path", pa.string()), pa.field("size", pa.int64()), pa.field("sha1", pa.string()),
    pa.field("md5", pa.string()), pa.field("mod_time", pa.string()), pa.field("hash_note", pa.string()),
    pa.field("verified", pa.bool_()), pa.field("recorded_at", pa.string()),
])
SOURCES = "sources.parquet"
SOURCES_OPTIONS = b"octfm.sources"         # sources.parquet's metadata key: how `make manifest` listed the dataset
MANIFEST_DIR = "manifest.parquet"
VOLUMES_DIR = "volumes"


# ---------------------------------------------------------------- the dataset root
def mirror_record_uri(root: str) -> str:
    return fsio.join(root, MIRROR_RECORD)


def mirror_record_table(rows: list[dict]) -> pa.Table:
    """The record's rows as the Arrow table `make mirror` writes."""
    return pa.Table.from_pylist(rows, schema=MIRROR_RECORD_SCHEMA)


def read_mirror_record(root: str) -> dict[str, dict]:
    """relpath -> expected hashes, from the record `make mirror` left beside the dataset."""
    uri = mirror_record_uri(root)
    if not fsio.exists(uri):
        return {}
    fs, path = fsio.filesystem(uri)
    rows = pq.read_table(path, filesystem=fs, columns=["path", "sha1", "md5"]).to_pylist()
    return {r["path"]: {"sha1": r["sha1"], "md5": r["md5"]} for r in rows}


# ---------------------------------------------------------------- the cache root
def sources_uri(cache: str) -> str:
    return fsio.join(cache, SOURCES)


def read_sources(cache: str) -> tuple[list[dict], dict] | None:
    """sources.parquet's rows and the options `make manifest` listed the dataset with ({} for a
    file written before they were recorded), or None when there is none."""
    uri = sources_uri(cache)
    if not fsio.exists(uri):
        return None
    table = schema.read_table(uri, schema.SOURCES_SCHEMA)
    fs, path = fsio.filesystem(uri)
    meta = pq.read_schema(path, filesystem=fs).metadata or {}
    return table.to_pylist(), json.loads(meta[SOURCES_OPTIONS]) if SOURCES_OPTIONS in meta else {}


def manifest_uri(cache: str) -> str:
    """The manifest: a directory of parts, one per shard (pandas.read_parquet reads it whole)."""
    return fsio.join(cache, MANIFEST_DIR)


def part_name(shard: tuple[int, int]) -> str:
    return f"part-{shard[0]:04d}-of-{shard[1]:04d}.parquet"


def part_uri(cache: str, shard: tuple[int, int]) -> str:
    return fsio.join(cache, MANIFEST_DIR, part_name(shard))


def volumes_uri(cache: str) -> str:
    return fsio.join(cache, VOLUMES_DIR)


def volume_relpath(relpath: str) -> str:
    """The cache path (relative to the cache root) of a source's volume:
    volumes/<relpath below retinal_oct/, without .dcm>.zarr."""
    rel = relpath.removeprefix(OCT_DIR + "/")
    stem = rel[:-4] if rel.lower().endswith(".dcm") else rel
    return posixpath.join(VOLUMES_DIR, stem + ".zarr")


def read_part(cache: str, shard: tuple[int, int]) -> pa.Table | None:
    """One shard's part, or None when it is missing."""
    uri = part_uri(cache, shard)
    return schema.read_table(uri, schema.CACHE_SCHEMA) if fsio.exists(uri) else None


def read_manifest_table(cache: str) -> pa.Table:
    """Every part of the cache manifest as one table, through pyarrow's dataset API (which skips
    hidden and temp files such as `.part-....tmp-*` a killed build left). Raises
    FileNotFoundError when the cache has no manifest."""
    uri = manifest_uri(cache)
    if not fsio.exists(uri):
        raise FileNotFoundError(uri)
    fs, path = fsio.filesystem(uri)
    return fail_cross_part_duplicates(ds.dataset(path, filesystem=fs, format="parquet",
                                                 schema=schema.CACHE_SCHEMA).to_table())


def duplicate_uids(rows) -> dict[str, str]:
    """relpath -> the relpath that keeps the image, for every later row whose SOP instance UID
    repeats an earlier one (by path order, so the choice is the same on every run). A repeated
    UID is the same image stored twice (or a broken export): training on both would weight it
    double and could put one image in two splits."""
    first: dict[str, str] = {}
    dups: dict[str, str] = {}
    for row in sorted(rows, key=lambda r: r["relpath"]):
        uid = row.get("sop_instance_uid")
        if not uid:
            continue
        if uid in first:
            dups[row["relpath"]] = first[uid]
        else:
            first[uid] = row["relpath"]
    return dups


def one_row_per_file(table: pa.Table) -> pa.Table:
    """A file in two manifest parts (shards split from sources.parquet files that differed) keeps one
    row: its first ok one, else its first; each such file is named on stderr."""
    rels = table["relpath"].to_pylist()
    if len(set(rels)) == len(rels):
        return table
    keep: dict[str, dict] = {}
    for r in table.to_pylist():
        have = keep.get(r["relpath"])
        if have is None or (have["status"] != "ok" and r["status"] == "ok"):
            keep[r["relpath"]] = r
    for rel in sorted(r for r, n in Counter(rels).items() if n > 1):
        print(f"warning: {rel} is listed in two manifest parts (shards split from different sources.parquet "
              f"files?): its {keep[rel]['status']} row kept", file=sys.stderr)
    return schema.to_table(list(keep.values()), schema.CACHE_SCHEMA)


def fail_cross_part_duplicates(table: pa.Table) -> pa.Table:
    """`make cache` fails a duplicate SOP instance UID (an unlisted file's header) only within
    its shard; read together, an ok row whose UID an ok row of another part holds fails here
    too (the first relpath keeps the image), and each pair is named on stderr. A file listed in
    two parts is one file, kept once (one_row_per_file), never a duplicate of itself."""
    table = one_row_per_file(table)
    ok = table.filter(pa.compute.equal(table["status"], "ok")).select(["relpath", "sop_instance_uid"]).to_pylist()
    dups = duplicate_uids(ok)
    if not dups:
        return table
    for rel, first in sorted(dups.items()):
        print(f"warning: duplicate SOP instance UID across manifest parts: {rel} repeats {first} (kept)",
              file=sys.stderr)
    rows = [{**r, "status": "failed", "volume": None,
             "error": f"duplicate SOP instance UID: {r['sop_instance_uid']} is also {dups[r['relpath']]}"}
            if r["status"] == "ok" and r["relpath"] in dups else r for r in table.to_pylist()]
    return schema.to_table(rows, schema.CACHE_SCHEMA)
