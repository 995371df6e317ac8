"""`make manifest`: AI-READI tables + one listing of the dataset -> sources.parquet.

One row per DICOM: every manifest.tsv row (present or not) and every unlisted .dcm found beside
the listed ones. Labels and splits are joined by participant. The dataset may be laid out as
released or as a group repacked it (docs/data.md, "Layouts"): the tables are looked for at the
root and in retinal_oct/, and a row finds its file at its own path first, else by its file name
(which carries the SOP Instance UID, unique in the release) anywhere under the root, ZIP archives
included.
"""
from __future__ import annotations

import argparse
import json
import posixpath
import re
import time
from collections import Counter
from typing import Sequence

import pandas as pd

from manifests import aireadi, paths, protocols, schema, splits
from manifests.paths import OCT_DIR
from octfm import archives, cli, fsio
from octfm.errors import DataError

PARTICIPANTS = "participants.tsv"
OCT_MANIFEST = "manifest.tsv"
# where the tables are looked for, in order (relative to the dataset root)
PARTICIPANTS_AT = (PARTICIPANTS, f"{OCT_DIR}/{PARTICIPANTS}")
OCT_MANIFEST_AT = (f"{OCT_DIR}/{OCT_MANIFEST}", OCT_MANIFEST)


def table_uri(root: str, given: str | None, candidates: tuple[str, ...], what: str, variable: str) -> str:
    """Where one of the two tables is: `given` (a URI or absolute path, else relative to the
    root), or the first candidate that exists. DataError naming every place tried."""
    if given:
        uri = given if ("://" in given or given.startswith("/")) else fsio.join(root, given)
        if not fsio.exists(uri):
            raise DataError(f"{variable}={given}: {uri} not found")
        return uri
    tried = [fsio.join(root, c) for c in candidates]
    for uri in tried:
        if fsio.exists(uri):
            return uri
    raise DataError(f"SOURCE={root}: {what} not found at {' or '.join(tried)} (is SOURCE the dataset root? "
                    f"{variable}=<path> names it)")


def list_dataset(root: str) -> tuple[dict[str, dict], dict[str, dict]]:
    """One recursive listing of the whole dataset root, ZIP archives at any depth opened in place.

    Returns relpath -> {size, version, source, archive, error} for plain files and archive
    members alike (octfm/archives.py maps a member to the path it stands for), and
    archive relpath -> {members, error} for every archive found.
    """
    out: dict[str, dict] = {}
    zips: list[str] = []
    for rel, info in fsio.list_tree(root).items():
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


def oct_or_other(rel: str) -> str | None:
    """None when an unlisted .dcm is structural OCT by its own path (under retinal_oct/) or name (a
    release name whose submodality is `oct`), else what it is instead: the submodality its name gives
    (flow_cube, enface, ir, ...) or "unknown". Never by what shares its archive or folder: a flow cube
    or a photograph zipped beside OCT files is not OCT."""
    name = posixpath.basename(rel)
    other = protocols.other_modality(name)
    if other:
        return other
    parsed = protocols.parse_file_name(name)
    if rel.startswith(OCT_DIR + "/") or (parsed and parsed.submodality == protocols.STRUCTURAL):
        return None
    return "unknown"


class Matcher:
    """A manifest row's file: at its own path first, else the one file of that name anywhere in
    the listing (AI-READI names carry the SOP Instance UID). Each file serves one row."""

    def __init__(self, listing: dict[str, dict]):
        self.listing = listing
        self.by_name: dict[str, list[str]] = {}
        for rel in sorted(listing):
            self.by_name.setdefault(posixpath.basename(rel), []).append(rel)
        self.claimed: dict[str, str] = {}   # listing relpath -> the manifest relpath it serves

    def claim_paths(self, rels) -> None:
        """First pass: every row whose file sits at its own path keeps it."""
        for rel in rels:
            if rel in self.listing:
                self.claimed.setdefault(rel, rel)

    def find(self, rel: str) -> tuple[str | None, str | None, str | None]:
        """(where the file is in the listing, "path" or "name", why not found)."""
        if self.claimed.get(rel) == rel:
            return rel, "path", None
        name = posixpath.basename(rel)
        cands = self.by_name.get(name, [])
        free = [c for c in cands if c not in self.claimed]
        if len(cands) > 1:
            return None, None, (f"ambiguous: {len(cands)} files are named {name}: " + ", ".join(cands[:3]) +
                                (" ..." if len(cands) > 3 else ""))
        if free:
            self.claimed[free[0]] = rel
            return free[0], "name", None
        if cands:
            return None, None, f"duplicate: the one file named {name} ({cands[0]}) serves row {self.claimed[cands[0]]}"
        return None, None, None


def _absent_reason(rel: str, zips: dict[str, dict]) -> str:
    """Why a manifest.tsv path is not in the listing: an unreadable archive that may hold it (one in
    its folder, or in a folder named for its scanner as a repacked bucket keeps them, or any, since a
    row is also looked for by name), else missing."""
    broken = [z for z, info in zips.items() if info["error"]]
    if not broken:
        return "missing: listed in manifest.tsv but not found in the dataset"
    device = aireadi.device_from_path(rel)
    near = [z for z in broken if (rel + "/").startswith(posixpath.dirname(z) + "/")] or \
        [z for z in broken if device and device in z.split("/")[:-1]]
    if near:
        others = f" (or one of {len(near) - 1} other unreadable archive(s) there)" if len(near) > 1 else ""
        return zips[near[0]]["error"] + others
    return (f"missing: not found in the dataset; {len(broken)} unreadable archive(s) may hold it: "
            + zips[broken[0]]["error"])


def _clean(v):
    """pandas missing values (NaN, NA) -> None, so Arrow string columns stay strings."""
    return None if v is None or (not isinstance(v, (list, str)) and pd.isna(v)) else v


def _int_or_none(v: str):
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return None


class Sources:
    """The dataset as one listing joined to the participants: makes each source row."""

    def __init__(self, root: str, people: pd.DataFrame):
        self.root, self.people = root, people
        self.listing, self.zips = list_dataset(root)
        self.mirror = paths.read_mirror_record(root)
        self.unknown_participants: set[str] = set()

    def base_row(self, pid: str, rel: str | None, raw_path: str, found: str | None) -> dict:
        """The participant's columns and where the file is."""
        info = self.people.loc[pid] if pid in self.people.index else None
        if info is None and pid:
            self.unknown_participants.add(pid)
        where = found or rel
        source = None
        if rel is not None:
            source = self.listing[where]["source"] if where in self.listing else fsio.join(self.root, rel)
        return {
            "participant_id": pid or None,
            "clinical_site": None if info is None else (_clean(info.get("clinical_site")) or None),
            "study_group": None if info is None else _clean(info["study_group"]),
            "label": None if info is None or pd.isna(info["label"]) else int(info["label"]),
            "split": None if info is None else _clean(info["split"]),
            "age": None if info is None else _int_or_none(_clean(info.get("age"))),
            "study_visit_date": None if info is None else (_clean(info.get("study_visit_date")) or None),
            "relpath": rel if rel is not None else raw_path,
            "source": source,
        }

    def listed_rows(self, oct_rows: pd.DataFrame) -> tuple[list[dict], Matcher]:
        """One row per manifest.tsv row, its file found at its path or by its name."""
        parsed = []
        for r in oct_rows.to_dict("records"):
            try:
                parsed.append((r, fsio.safe_relpath(r["filepath"], required_prefix=OCT_DIR), None))
            except fsio.PathEscapeError as exc:
                parsed.append((r, None, f"bad path in manifest.tsv: {exc}"))
        matcher = Matcher(self.listing)
        matcher.claim_paths(rel for _, rel, _ in parsed if rel is not None)
        rows, seen = [], set()
        for r, rel, error in parsed:
            found, how = None, None
            if rel is not None:
                if rel in seen:
                    error = "duplicate: manifest.tsv lists this file more than once"
                seen.add(rel)
                if error is None:
                    found, how, why = matcher.find(rel)
                    error = self.listing[found]["error"] if found else (why or _absent_reason(rel, self.zips))
            rows.append(self.listed_row(r, rel, found, how, error))
        return rows, matcher

    def listed_row(self, r: dict, rel: str | None, found: str | None, how: str | None, error: str | None) -> dict:
        row = self.base_row(r["participant_id"], rel, r["filepath"], found)
        shape = [_int_or_none(r["number_of_frames"]), _int_or_none(r["height"]), _int_or_none(r["width"])]
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
            "listed": True, "found_by": how, "tsv_shape": None if None in shape else shape,
        })
        _add_protocol(row, posixpath.basename(rel or ""))
        if error is None and row["device"] is None:
            error = "unknown device: neither the path nor manufacturer/model name a known scanner"
        _attach_listing(row, found, self.listing, self.mirror)
        row["manifest_error"] = error
        return row

    def unlisted_rows(self, claimed) -> tuple[list[dict], dict[str, str]]:
        """Rows for the structural OCT files manifest.tsv does not list, and relpath -> kind for
        every other DICOM, ignored (flow cubes, photographs: oct_or_other)."""
        rows, ignored = [], {}
        for rel in sorted(self.listing):
            if rel in claimed or not rel.lower().endswith(".dcm"):
                continue
            other = oct_or_other(rel)
            if other:
                ignored[rel] = other
            else:
                rows.append(_unlisted_row(rel, self.listing, self.mirror, self.base_row))
        return rows, ignored


def build_sources(root: str, seed: int = 0, oct_manifest: str | None = None,
                  participants_tsv: str | None = None) -> tuple[list[dict], dict]:
    """The source rows and a summary dict (counts and warnings) for the dataset at `root`.
    `oct_manifest` and `participants_tsv` name the tables where they are not in a usual place."""
    p_uri = table_uri(root, participants_tsv, PARTICIPANTS_AT, PARTICIPANTS, "PARTICIPANTS")
    m_uri = table_uri(root, oct_manifest, OCT_MANIFEST_AT, f"the OCT {OCT_MANIFEST}", "OCT_MANIFEST")
    participants, warnings = aireadi.parse_participants(fsio.read_text(p_uri), where=p_uri)
    participants, n_resplit = splits.fill_splits(participants, seed=seed)
    oct_rows = aireadi.parse_oct_manifest(fsio.read_text(m_uri), where=m_uri)
    src = Sources(root, participants.set_index("participant_id"))
    rows, matcher = src.listed_rows(oct_rows)
    unlisted, ignored = src.unlisted_rows(matcher.claimed)
    rows += unlisted
    by_rel = {r["relpath"]: r for r in rows}
    for rel, first in paths.duplicate_uids(r for r in rows if not r["manifest_error"]).items():
        by_rel[rel]["manifest_error"] = f"duplicate SOP instance UID: {by_rel[rel]['sop_instance_uid']} is also {first}"
    if src.unknown_participants:
        warnings.append(f"{len(src.unknown_participants)} participant(s) in manifest.tsv are not in "
                        "participants.tsv: null label")
    leaks = splits.split_leaks(pd.DataFrame(rows))
    if leaks:  # cannot happen by construction; guard the invariant anyway
        raise RuntimeError(f"participants in two splits: {leaks[:10]}")
    found_by = Counter(r["found_by"] for r in rows if r["listed"])
    summary = {
        "participants": len(participants), "resplit": n_resplit, "rows": len(rows),
        "unlisted": len(unlisted),
        "row_errors": Counter(cli.reason(r["manifest_error"]) for r in rows if r["manifest_error"]),
        "devices": Counter(r["device"] for r in rows), "splits": Counter(r["split"] for r in rows),
        "mirror_hashes": sum(bool(r["expected_sha1"] or r["expected_md5"]) for r in rows),
        "warnings": warnings, "archives": _archive_summary(src.zips, src.listing, rows, set(matcher.claimed)),
        "tables": {"participants": p_uri, "oct_manifest": m_uri},
        "layout": _layout_name(found_by), "by_path": found_by["path"], "by_name": found_by["name"],
        "not_found": found_by[None], "ignored": sorted(ignored), "ignored_by": Counter(ignored.values()),
        "protocol_by": Counter(r["protocol_by"] or "none" for r in rows if not r["manifest_error"]),
        "geometry_warnings": Counter(r["protocol"] for r in rows if r.get("geometry_warning")),
    }
    return rows, summary


def _layout_name(found_by: Counter) -> str:
    if found_by["name"] and not found_by["path"]:
        return "repacked (files found by name)"
    if found_by["name"]:
        return "mixed (files found by path and by name)"
    return "as released (files at their manifest paths)"


def _add_protocol(row: dict, file_name: str) -> None:
    """protocol, scan_pattern and field_mm as the file name and the published table give them, and
    where manifest.tsv's spacing disagrees with that field (AI-READI's metadata step copies it from the
    header); `make cache` reads the header's witnesses too (ingest/scan.py)."""
    protocol = protocols.from_file_name(file_name)
    row["protocol"] = protocol
    row["protocol_by"] = "name" if protocol else None
    row["scan_pattern"] = protocols.published_pattern(protocol)
    row["field_mm"] = protocols.published_field(protocol)
    row["geometry_warning"] = _tsv_geometry(row)


def _numbers(text: str | None) -> list[float]:
    return [float(v) for v in re.findall(r"\d+(?:\.\d+)?(?:[eE]-?\d+)?", text or "")]


def _tsv_geometry(row: dict) -> str | None:
    """manifest.tsv's spacing x shape against the protocol's published field, across frames and along
    B-scans: the Cirrus macular cube's overwritten Slice Thickness shows here, before any file is read."""
    field, shape = row["field_mm"], row.get("tsv_shape")
    if not field or not shape or row["scan_pattern"] != protocols.RASTER:
        return None
    thickness, spacing = _numbers(row.get("slice_thickness")), _numbers(row.get("pixel_spacing"))
    said = [thickness[0] * shape[0] if len(thickness) == 1 else None,
            spacing[1] * shape[2] if len(spacing) == 2 else None]
    out = [protocols.disagreement(geometry_axis, {"manifest.tsv": tsv, "published": published})
           for geometry_axis, tsv, published in ((protocols.AXES[0], said[0], field[0]), (protocols.AXES[2], said[1], field[2]))]
    out = [o for o in out if o]
    return "geometry: " + "; ".join(out) + " (the header decides at make cache)" if out else None


def _unlisted_row(rel: str, listing: dict, mirror: dict, base_row) -> dict:
    """A .dcm beside the listed ones that manifest.tsv does not list: kept (listed=False), its
    participant from the folder below the device's."""
    parts = rel.split("/")
    device = aireadi.device_from_path(rel)
    pid = parts[parts.index(device) + 1] if device and parts.index(device) + 1 < len(parts) - 1 else None
    named = protocols.parse_file_name(posixpath.basename(rel))
    if named:   # a release name says its participant, and its protocol says the scanner
        pid = pid or named.participant
        device = device or getattr(protocols.known(named.protocol), "device", None)
    if "::" in rel:  # an archive member whose name is unsafe: its folders mean nothing
        pid = None
    row = base_row(pid or "", rel, rel, rel)
    row.update({"device": device, "listed": False, "found_by": None,
                "laterality": named.laterality.upper() if named else None})
    _add_protocol(row, posixpath.basename(rel))
    _attach_listing(row, rel, listing, mirror)
    row["manifest_error"] = listing[rel]["error"] or (None if device else
                                                      "unknown device: file not under a known scanner folder")
    return row


def _archive_summary(zips: dict, listing: dict, rows: list[dict], listed: set[str]) -> dict | None:
    """How archive members and manifest.tsv rows matched up (None when there are no archives);
    `listed`: the listing paths that serve a manifest.tsv row."""
    if not zips:
        return None
    in_zip = {rel for rel, info in listing.items() if info["archive"]}
    return {
        "archives": len(zips), "unreadable": sorted(z for z, i in zips.items() if i["error"]),
        "members": sum(i["members"] for i in zips.values()),
        "matched": len(in_zip & listed),
        "unlisted_dcm": sum(1 for rel in in_zip - listed if rel.lower().endswith(".dcm")),
        "other": sorted(rel for rel in in_zip - listed if not rel.lower().endswith(".dcm")),
        "duplicates": sorted(d for i in zips.values() for d in i["duplicates"]),
        "rows_without_file": sum(1 for r in rows if r["listed"] and not r["found_by"]),
    }


def _attach_listing(row: dict, rel: str | None, listing: dict, mirror: dict) -> None:
    info = listing.get(rel or "", {})
    row["size"] = info.get("size")
    row["source_version"] = info.get("version")
    rec = mirror.get(rel or "", {})
    row["expected_sha1"] = rec.get("sha1") or None
    row["expected_md5"] = rec.get("md5") or None


def sources_options(root: str, seed: int = 0, oct_manifest: str | None = None,
                    participants_tsv: str | None = None) -> dict:
    """build_sources' arguments, as sources.parquet records them."""
    return {"root": root.rstrip("/"), "seed": seed, "oct_manifest": oct_manifest, "participants_tsv": participants_tsv}


def write_sources(rows: list[dict], out: str, options: dict | None = None) -> None:
    """sources.parquet; `options` (the root, the tables' places, the split seed) ride in its
    metadata, so `make cache` lists the same dataset the same way (paths.read_sources)."""
    table = schema.to_table(rows, schema.SOURCES_SCHEMA)
    if options:
        table = table.replace_schema_metadata({**table.schema.metadata, paths.SOURCES_OPTIONS: json.dumps(options)})
    fsio.write_parquet_atomic(table, out)


def print_summary(summary: dict, out: str, root: str, seconds: float) -> None:
    print(f"manifest: read {root}, wrote {out} ({summary['rows']} rows, {summary['participants']} participants, {seconds:.1f}s)")
    t = summary["tables"]
    print(f"layout: {summary['layout']}; participants.tsv: {t['participants']}; manifest.tsv: {t['oct_manifest']}")
    print(f"manifest.tsv rows: {summary['by_path']} found at their path, {summary['by_name']} found by file name, "
          f"{summary['not_found']} not found")
    if summary["ignored"]:
        kinds = ", ".join(f"{k} {v}" for k, v in summary["ignored_by"].most_common())
        print(f"note: {len(summary['ignored'])} .dcm file(s) that are not structural OCT ignored ({kinds}: by their "
              "path or name), e.g. " + ", ".join(summary["ignored"][:3]))
    warned = summary["geometry_warnings"]
    if warned:
        print("geometry: manifest.tsv's spacing disagrees with the published field (make cache reads the headers): "
              + ", ".join(f"{p} {n}" for p, n in warned.most_common()))
    by = summary["protocol_by"]
    print(f"protocol told by the file name: {by['name']} row(s); left to the header (Protocol Name, traces, shape): "
          f"{by['none']}")
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
    ap.add_argument("--oct-manifest", default=None, help="the OCT manifest.tsv when it is not at <root>/retinal_oct/ "
                    "or <root>/ (make OCT_MANIFEST=...; a URI, an absolute path, or a path under the root)")
    ap.add_argument("--participants", default=None, help="participants.tsv when it is not at <root>/ or "
                    "<root>/retinal_oct/ (make PARTICIPANTS=...)")
    ap.add_argument("--strict", action="store_true", help="exit 3 when any row cannot be cached")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    options = sources_options(args.source, args.seed, args.oct_manifest, args.participants)
    rows, summary = build_sources(**options)
    write_sources(rows, args.out, options)
    print_summary(summary, args.out, args.source, time.perf_counter() - t0)
    return cli.strict_status(sum(summary["row_errors"].values()), args.strict)


if __name__ == "__main__":
    cli.run(main)
