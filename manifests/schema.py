"""Fixed Arrow schemas for sources.parquet and the cache manifest.

Why fixed: a part whose `error` column is all null must still type it as string, or the
parts of a sharded build would not read back as one table.
"""
from __future__ import annotations

import json
import os

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from octfm import fsio

SOURCE_FIELDS = [
    pa.field("participant_id", pa.string()),
    pa.field("clinical_site", pa.string()),
    pa.field("study_group", pa.string()),
    pa.field("label", pa.int8()),
    pa.field("split", pa.string()),
    pa.field("device", pa.string()),
    pa.field("manufacturer", pa.string()),
    pa.field("manufacturers_model_name", pa.string()),
    pa.field("anatomic_region", pa.string()),
    pa.field("imaging", pa.string()),
    pa.field("laterality", pa.string()),
    pa.field("sop_instance_uid", pa.string()),
    pa.field("relpath", pa.string()),          # relative to the dataset root, POSIX
    pa.field("source", pa.string()),           # full URI of the file
    pa.field("listed", pa.bool_()),            # present in retinal_oct/manifest.tsv
    pa.field("size", pa.int64()),              # bytes, from the one listing
    pa.field("source_version", pa.string()),   # mtime / generation / etag from the listing
    pa.field("tsv_shape", pa.list_(pa.int32())),  # frames, height, width as manifest.tsv says
    pa.field("expected_sha1", pa.string()),    # from the mirror record, when it has one
    pa.field("expected_md5", pa.string()),
    pa.field("manifest_error", pa.string()),   # why the row cannot be read at all (missing, escape)
    # kept as AI-READI gives them, for users who filter on them
    pa.field("age", pa.int16()),                  # participants.tsv (years; null when not a number, e.g. "89+")
    pa.field("study_visit_date", pa.string()),    # participants.tsv, as written there
    pa.field("pixel_spacing", pa.string()),       # manifest.tsv's own string ("Varies by frame", "Not reported", ...)
    pa.field("slice_thickness", pa.string()),     # manifest.tsv's own string
    pa.field("reference_filepath", pa.string()),  # manifest.tsv: the image this one refers to (e.g. an OCTA's)
    # where the file was found: "path" (at manifest.tsv's path), "name" (by file name elsewhere: a repacked
    # bucket), null (not found, or a file manifest.tsv does not list)
    pa.field("found_by", pa.string()),
    # the scan (manifests/protocols.py): Protocol Name normalised, from the file name here and the header in the
    # cache manifest; raster | radial | line; the physical extent across frames, in depth, along columns (mm)
    pa.field("protocol", pa.string()),
    pa.field("protocol_by", pa.string()),     # the witness that named the protocol: name | header | shape (null: none)
    pa.field("scan_pattern", pa.string()),
    pa.field("field_mm", pa.list_(pa.float64())),
    # where the scan's witnesses of its extent disagree, each one's value: manifest.tsv's spacing against the published
    # field here; the header's, the published field and the frames' traces in the cache manifest (ingest/scan.py)
    pa.field("geometry_warning", pa.string()),
]

CACHE_FIELDS = SOURCE_FIELDS + [
    pa.field("status", pa.string()),           # ok | failed | skipped (not selected: configs/cache.yaml select)
    pa.field("error", pa.string()),            # why a failed row failed, else null
    pa.field("skip_reason", pa.string()),      # why a skipped row was not cached, else null
    pa.field("volume", pa.string()),           # Zarr array path relative to the cache root
    pa.field("shape", pa.list_(pa.int32())),   # stored D, H, W
    pa.field("native_shape", pa.list_(pa.int32())),  # frames, rows, cols decoded
    pa.field("lo", pa.float64()),              # normalisation window, source units
    pa.field("hi", pa.float64()),
    pa.field("spacing_mm", pa.list_(pa.float64())),         # stored voxel size D, H, W
    pa.field("native_spacing_mm", pa.list_(pa.float64())),  # frame, row, col spacing
    pa.field("flipped_axes", pa.list_(pa.int32())),  # axes reversed to the common orientation
    pa.field("flipped", pa.string()),          # what was reversed and which witness said so (null: nothing)
    pa.field("crop_pad", pa.list_(pa.int32())),  # resample: spacing: voxels padded (+) or cut (-) per axis to the shape
    pa.field("transfer_syntax", pa.string()),
    pa.field("bits_stored", pa.int32()),
    pa.field("sha1", pa.string()),             # SHA-1 of the bytes read
    pa.field("decode_s", pa.float64()),
    pa.field("preprocess_s", pa.float64()),
    pa.field("total_s", pa.float64()),
    pa.field("cache_key", pa.string()),
    pa.field("code_version", pa.string()),
    pa.field("reading_key", pa.string()),      # the header-reading code's key (ingest/scan.py): a change re-reads
    pa.field("scan_key", pa.string()),         # the cache key and the header's reading that made the volume
]


def with_nullable_ints(fields: list[pa.Field]) -> pa.Schema:
    """The schema with pandas metadata that makes every integer column a nullable pandas
    integer (Int64) on read, so `label` with nulls reads as 0-3 and <NA>, not as float."""
    cols = [{"name": f.name, "field_name": f.name, "pandas_type": "int64", "numpy_type": "Int64", "metadata": None}
            for f in fields if pa.types.is_integer(f.type)]
    meta = {"index_columns": [], "column_indexes": [], "columns": cols, "pandas_version": pd.__version__}
    return pa.schema(fields, metadata={b"pandas": json.dumps(meta).encode()})


SOURCES_SCHEMA = with_nullable_ints(SOURCE_FIELDS)
CACHE_SCHEMA = with_nullable_ints(CACHE_FIELDS)

TIMING_COLUMNS = ("decode_s", "preprocess_s", "total_s")


def to_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """Rows (dicts) -> a Table with exactly `schema`; absent keys become null."""
    cols = {f.name: [r.get(f.name) for r in rows] for f in schema}
    return pa.Table.from_pydict(cols, schema=schema)


def frame_to_rows(df: pd.DataFrame) -> list[dict]:
    """A DataFrame read from our Parquet -> plain Python rows (lists, None for nulls)."""
    table = pa.Table.from_pandas(df, preserve_index=False)
    return table.to_pylist()


def read_table(uri: str, schema: pa.Schema | None = None) -> pa.Table:
    """Read a Parquet file or a directory of parts (local or gs://) as one table."""
    fs, path = fsio.filesystem(uri)
    if fs.isdir(path):
        files = sorted(p for p in fs.find(path) if p.endswith(".parquet") and not os.path.basename(p).startswith("."))
        tables = [pq.read_table(p, filesystem=fs, schema=schema) for p in files]
        if not tables:
            return (schema or pa.schema([])).empty_table()
        return pa.concat_tables(tables)
    return pq.read_table(path, filesystem=fs, schema=schema)


def read_manifest(uri: str) -> pd.DataFrame:
    """The cache manifest as pandas (what researchers do: pandas.read_parquet works as well)."""
    return read_table(uri, CACHE_SCHEMA).to_pandas()
