"""`make cache` checks the bytes it reads against the mirror record: SHA-1 where the source listing
had one (B2's small files, a local copy), MD5 where it had only that (S3 ETags, B2 large files).
Each check is tested on its own record: a record with an MD5 and no SHA-1 is what
an S3 or B2 listing gives, and no other fast test tampers a file under one, so a worker that let an
MD5 mismatch through would pass."""
from __future__ import annotations

import hashlib

import pandas as pd
import pyarrow.parquet as pq
import pytest

from ingest import synth
from manifests import paths

SMALL = {"preprocess": {"target_shape": [16, 48, 48]}}


def _tamper(path) -> None:
    """Same size, other content: the listing's size check cannot see it."""
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _record(root, files: dict[str, dict]) -> None:
    """octfm_mirror.parquet at the dataset root, as `make mirror` writes it: {relpath: {"sha1": .., "md5": ..}}."""
    rows = [{"path": rel, "size": (root / rel).stat().st_size, "sha1": h.get("sha1"), "md5": h.get("md5"),
             "mod_time": None, "hash_note": "test", "verified": True, "recorded_at": "2025-01-01T00:00:00"}
            for rel, h in files.items()]
    pq.write_table(paths.mirror_record_table(rows), root / paths.MIRROR_RECORD)


def _hashes(path) -> dict[str, str]:
    data = path.read_bytes()
    return {"sha1": hashlib.sha1(data).hexdigest(), "md5": hashlib.md5(data).hexdigest()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Three files under a mirror record, then the cache built: `md5` (an MD5 and no SHA-1, then
    changed), `sha1` (a SHA-1 and no MD5, then changed) and `both` (both hashes, unchanged).
    Returns ({name: relpath}, {name: hashes before}, {name: hashes after}, manifest)."""
    from cache import build
    from cache.config import CacheConfig
    from octfm import config

    def built_rows(cache) -> pd.DataFrame:
        build.build(str(root), str(cache), config.from_dict(CacheConfig, SMALL), progress=False)
        return pd.read_parquet(cache / "manifest.parquet")

    root = tmp_path_factory.mktemp("checksums") / "dataset"
    synth.generate(root, synth.SynthConfig(participants=3, scale=16, seed=2, bad_files=False, unlabeled=0))
    cached = built_rows(root.parent / "unrecorded")  # which files become volumes (a radial scan is skipped)
    rels = sorted(cached[cached.status == "ok"].relpath)[:3]
    names = dict(zip(("md5", "sha1", "both"), rels))
    before = {n: _hashes(root / rel) for n, rel in names.items()}
    _record(root, {names["md5"]: {"md5": before["md5"]["md5"]}, names["sha1"]: {"sha1": before["sha1"]["sha1"]},
                   names["both"]: before["both"]})
    for n in ("md5", "sha1"):
        _tamper(root / names[n])
    after = {n: _hashes(root / rel) for n, rel in names.items()}
    return names, before, after, built_rows(root.parent / "cache")


def _row(built, name: str) -> pd.Series:
    names, _, _, df = built
    return df[df.relpath == names[name]].iloc[0]


def test_a_record_with_an_md5_and_no_sha1_fails_a_changed_file_on_its_md5(built):
    _, before, after, _ = built
    row = _row(built, "md5")
    assert row.expected_md5 == before["md5"]["md5"] and pd.isna(row.expected_sha1)  # what S3 and B2 listings give
    assert row.status == "failed"
    assert row.error == (f"checksum mismatch: MD5 {after['md5']['md5']} differs from the mirror record "
                         f"{before['md5']['md5']}")


def test_a_record_with_a_sha1_fails_a_changed_file_on_its_sha1(built):
    _, before, after, _ = built
    row = _row(built, "sha1")
    assert row.expected_sha1 == before["sha1"]["sha1"] and pd.isna(row.expected_md5)
    assert row.status == "failed"
    assert row.error == (f"checksum mismatch: SHA-1 {after['sha1']['sha1']} differs from the mirror record "
                         f"{before['sha1']['sha1']}")


def test_an_unchanged_file_passes_both_checks(built):
    """The control: both hashes recorded and the bytes as recorded, so the failures above are the
    checks' and not the record's."""
    _, before, _, df = built
    row = _row(built, "both")
    assert row.status == "ok" and row.sha1 == row.expected_sha1 == before["both"]["sha1"]
    assert (df[~df.relpath.isin(built[0].values())].status != "failed").all()
