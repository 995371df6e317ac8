"""`make manifest`: AI-READI tables + one listing of the dataset -> sources.parquet.

One row per DICOM: every manifest.tsv row (present or not) and every .dcm found under
retinal_oct/ that manifest.tsv does not list. Labels and splits are joined by participant.
"""
from __future__ import annotations

import argparse
import posixpath
import time
from collections import Counter
from typing import Sequence

import pandas as pd

from manifests import aireadi, layout, schema, splits
from manifests.layout import OCT_DIR
from octfm import archives, cli, fsio
from octfm.errors import DataError



def list_dataset(root: str) -> tuple[dict[str, dict], dict[str, dict]]:
    """One recursive listing of <root>/retinal_oct, ZIP archives opened in place.

    Returns relpath -> {size, version, source, archive, error} for plain files and archive
    members alike (octfm/archives.py maps a member to the path it stands for), and
    archive relpath -> {members, error} for every archive found.
    """
    out: dict[str, dict] = {}
    zips: list[str] = []
    for sub, info in fsio.list_tree(fsio.join(root, OCT_DIR)).items():
        rel = f"{OCT_DIR}/{sub}"
        if archives.is_archive(rel):
            zips.append(rel)
            continue
        version = info.get("generation") or info.get("md5Hash") or info.get("etag") or info.get("mtime") or info.get("updated")
        out[rel] = {"size": int(info.get("size") or 0), "version": str(version) if version is not None else None,
                    "source": fsio.join(root, rel), "archive": None, "error": None}
    return out, _add_archive_members(root, sorted(zips), out)


def _add_archive_members(root: str, zips: list[str], listing: dict) -> dict[str, dict]:
    """Add every archive's members to `listing` (a path already present keeps its first
    source) and return archive relpath -> {members, error, duplicates}."""
    report: dict[str, dict] = {}
    seen = dict.fromkeys(listing, "a plain file")
    for rel, (members, error) in archives.list_archives(root, zips).items():
        keep, dups = archives.first_source_wins(members, rel, seen)
        report[rel] = {"members": len(members), "error": error, "duplicates": [m.relpath for m, _ in dups]}
        for m in keep:
            listing[m.relpath] = {"size": m.size, "version": m.version, "source": m.uri, "archive": rel,
                                  "error": m.error}
    return report


def _absent_reason(rel: str, zips: dict[str, dict]) -> str:
    """Why a manifest.tsv path is not in the listing: an unreadable archive in its folder
    may hold it; otherwise it is missing."""
    broken = [z for z, info in zips.items() if info["error"] and (rel + "/").startswith(posixpath.dirname(z) + "/")]
    if broken:
        return zips[broken[0]]["error"] + (f" (or one of {len(broken) - 1} other unreadable archive(s) here)"
                                           if len(broken) > 1 else "")
    return "missing: listed in manifest.tsv but not found in the dataset"


def _clean(v):
    """pandas missing values (NaN, NA) -> None, so Arrow string columns stay strings."""
    return None if v is None or (not isinstance(v, (list, str)) and pd.isna(v)) else v


def _int_or_none(v: str):
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return None


def build_sources(root: str, seed: int = 0) -> tuple[list[dict], dict]:
    """The source rows and a summary dict (counts and warnings) for the dataset at `root`."""
    p_uri, m_uri = fsio.join(root, "participants.tsv"), fsio.join(root, OCT_DIR, "manifest.tsv")
    for uri in (p_uri, m_uri):
        if not fsio.exists(uri):
            raise DataError(f"SOURCE={root}: {uri} not found (is SOURCE the dataset root?)")
    participants, warnings = aireadi.parse_participants(fsio.read_text(p_uri), where=p_uri)
    participants, n_resplit = splits.fill_splits(participants, seed=seed)
    oct_rows = aireadi.parse_oct_manifest(fsio.read_text(m_uri), where=m_uri)
    listing, zips = list_dataset(root)
    mirror = layout.read_mirror_record(root)
    people = participants.set_index("participant_id")

    rows: list[dict] = []
    seen: set[str] = set()
    unknown_participants: set[str] = set()

    def base_row(pid: str, rel: str | None, raw_path: str) -> dict:
        info = people.loc[pid] if pid in people.index else None
        if info is None and pid:
            unknown_participants.add(pid)
        label = None if info is None or pd.isna(info["label"]) else int(info["label"])
        return {
            "participant_id": pid or None,
            "clinical_site": None if info is None else (_clean(info.get("clinical_site")) or None),
            "study_group": None if info is None else _clean(info["study_group"]),
            "label": label,
            "split": None if info is None else _clean(info["split"]),
            "age": None if info is None else _int_or_none(_clean(info.get("age"))),
            "study_visit_date": None if info is None else (_clean(info.get("study_visit_date")) or None),
            "relpath": rel if rel is not None else raw_path,
            "source": (listing[rel]["source"] if rel in listing else fsio.join(root, rel)) if rel is not None else None,
        }

    for r in oct_rows.to_dict("records"):
        pid = r["participant_id"]
        try:
            rel = fsio.safe_relpath(r["filepath"], required_prefix=OCT_DIR)
            error = None
        except fsio.PathEscapeError as exc:
            rel, error = None, f"bad path in manifest.tsv: {exc}"
        row = base_row(pid, rel, r["filepath"])
        row.update({
            "device": aireadi.device_from_path(rel or "", r["manufacturer"], r["manufacturers_model_name"]),
            "manufacturer": r["manufacturer"] or None,
            "manufacturers_model_name": r["manufacturers_model_name"] or None,
            "anatomic_region": r["anatomic_region"] or None,
            "imaging": r["imaging"] or None,
            "laterality": aireadi.normalize_laterality(r["laterality"]),
            "sop_instance_uid": r["sop_instance_uid"] or None,
            "pixel_spacing": r["pixel_spacing"] or None,
            "slice_thickness": r["slice_thickness"] or None,
            "reference_filepath": r["reference_filepath"] or None,
            "listed": True,
            "tsv_shape": [_int_or_none(r["number_of_frames"]), _int_or_none(r["height"]), _int_or_none(r["width"])],
        })
        if None in row["tsv_shape"]:
            row["tsv_shape"] = None
        if rel is not None:
            if rel in seen:
                error = "duplicate: manifest.tsv lists this file more than once"
            seen.add(rel)
            if error is None and rel not in listing:
                error = _absent_reason(rel, zips)
            elif error is None:
                error = listing[rel]["error"]
        if error is None and row["device"] is None:
            error = "unknown device: neither the path nor manufacturer/model name a known scanner"
        _attach_listing(row, rel, listing, mirror)
        row["manifest_error"] = error
        rows.append(row)

    for rel in sorted(listing):
        if rel in seen or not rel.lower().endswith(".dcm"):
            continue
        parts = rel.split("/")
        device = aireadi.device_from_path(rel)
        pid = parts[parts.index(device) + 1] if device and parts.index(device) + 1 < len(parts) - 1 else None
        if "::" in rel:  # an archive member whose name is unsafe: its folders mean nothing
            pid = None
        row = base_row(pid or "", rel, rel)
        row.update({"device": device, "listed": False, "laterality": None})
        _attach_listing(row, rel, listing, mirror)
        row["manifest_error"] = listing[rel]["error"] or (None if device else
                                                          "unknown device: file not under a known scanner folder")
        rows.append(row)

    by_rel = {r["relpath"]: r for r in rows}
    for rel, first in layout.duplicate_uids(r for r in rows if not r["manifest_error"]).items():
        row = by_rel[rel]
        row["manifest_error"] = f"duplicate SOP instance UID: {row['sop_instance_uid']} is also {first}"
    if unknown_participants:
        warnings.append(f"{len(unknown_participants)} participant(s) in manifest.tsv are not in participants.tsv: null label")
    leaks = splits.split_leaks(pd.DataFrame(rows))
    if leaks:  # cannot happen by construction; guard the invariant anyway
        raise RuntimeError(f"participants in two splits: {leaks[:10]}")
    summary = {
        "participants": len(participants), "resplit": n_resplit, "rows": len(rows),
        "unlisted": sum(not r["listed"] for r in rows),
        "row_errors": Counter(cli.reason(r["manifest_error"]) for r in rows if r["manifest_error"]),
        "devices": Counter(r["device"] for r in rows), "splits": Counter(r["split"] for r in rows),
        "mirror_hashes": sum(bool(r["expected_sha1"] or r["expected_md5"]) for r in rows),
        "warnings": warnings, "archives": _archive_summary(zips, listing, rows),
    }
    return rows, summary


def _archive_summary(zips: dict, listing: dict, rows: list[dict]) -> dict | None:
    """How archive members and manifest.tsv rows matched up (None when there are no archives)."""
    if not zips:
        return None
    in_zip = {rel for rel, info in listing.items() if info["archive"]}
    listed = {r["relpath"] for r in rows if r["listed"]}
    return {
        "archives": len(zips), "unreadable": sorted(z for z, i in zips.items() if i["error"]),
        "members": sum(i["members"] for i in zips.values()),
        "matched": len(in_zip & listed),
        "unlisted_dcm": sum(1 for rel in in_zip - listed if rel.lower().endswith(".dcm")),
        "other": sorted(rel for rel in in_zip - listed if not rel.lower().endswith(".dcm")),
        "duplicates": sorted(d for i in zips.values() for d in i["duplicates"]),
        "rows_without_file": sum(1 for r in rows if r["listed"] and r["relpath"] not in listing),
    }


def _attach_listing(row: dict, rel: str | None, listing: dict, mirror: dict) -> None:
    info = listing.get(rel or "", {})
    row["size"] = info.get("size")
    row["source_version"] = info.get("version")
    rec = mirror.get(rel or "", {})
    row["expected_sha1"] = rec.get("sha1") or None
    row["expected_md5"] = rec.get("md5") or None


def write_sources(rows: list[dict], out: str) -> None:
    fsio.write_parquet_atomic(schema.to_table(rows, schema.SOURCES_SCHEMA), out)


def print_summary(summary: dict, out: str, root: str, seconds: float) -> None:
    print(f"manifest: read {root}, wrote {out} ({summary['rows']} rows, {summary['participants']} participants, {seconds:.1f}s)")
    print(cli.format_table(["device", "files"], sorted(((k or "unknown"), v) for k, v in summary["devices"].items())))
    print("splits: " + ", ".join(f"{k}={v}" for k, v in sorted((str(k), v) for k, v in summary["splits"].items())))
    if summary["resplit"]:
        print(f"split: {summary['resplit']} participant(s) had no recommended_split: seeded stratified 70/15/15")
    if summary["unlisted"]:
        print(f"note: {summary['unlisted']} .dcm file(s) found that manifest.tsv does not list (kept, listed=False)")
    for reason, n in summary["row_errors"].items():
        print(f"rows that cannot be cached: {n} {reason}")
    z = summary.get("archives")
    if z:
        print(f"archives: {z['archives']} ZIP archive(s), {z['members']} member(s): {z['matched']} match manifest.tsv "
              f"rows, {z['unlisted_dcm']} .dcm member(s) match no row (kept, listed=False), {len(z['other'])} other "
              f"member(s) ignored; {z['rows_without_file']} manifest.tsv row(s) match no member or file")
        for a in z["unreadable"]:
            print(f"archive unreadable, its rows failed: {a}")
        if z["other"]:
            print(f"ignored archive members (not .dcm): {', '.join(z['other'][:5])}{' ...' if len(z['other']) > 5 else ''}")
        if z["duplicates"]:
            print(f"warning: {len(z['duplicates'])} archive member path(s) already seen (first source kept): "
                  f"{', '.join(z['duplicates'][:5])}")
    print(f"mirror record hashes attached: {summary['mirror_hashes']}")
    for w in summary["warnings"]:
        print(f"warning: {w}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make manifest", description=__doc__)
    ap.add_argument("--source", required=True, help="dataset root (local folder or gs://bucket/path)")
    ap.add_argument("--out", required=True, help="where to write sources.parquet")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fallback split")
    ap.add_argument("--strict", action="store_true", help="exit 3 when any row cannot be cached")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows, summary = build_sources(args.source, seed=args.seed)
    write_sources(rows, args.out)
    print_summary(summary, args.out, args.source, time.perf_counter() - t0)
    return cli.strict_status(sum(summary["row_errors"].values()), args.strict)


if __name__ == "__main__":
    cli.run(main)
