"""ZIP archives as dataset sources: members listed from the central directory and read in
place, never expanded first.

Layout rule: an archive at `<dir>/<name>.zip` holding the member `<m>` stands for the file
`<dir>/<m>` (the archive's folder is its members' root). So the member `1001/x.dcm` of
`retinal_oct/structural_oct/topcon_triton/part1.zip` is
`retinal_oct/structural_oct/topcon_triton/1001/x.dcm`, the path manifest.tsv lists. Any
number of archives may share a folder, and plain files and archives may be mixed.

Why the central directory: it sits at the end of the archive and holds every member's name,
sizes and CRC-32, so a listing reads only the archive's tail; a member's bytes are then a
range read through fsspec (`zip://member::archive`) that zipfile checks against that CRC-32.
"""
from __future__ import annotations

import contextlib
import dataclasses
import posixpath
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor

from octfm import cli, fsio

SUFFIX = ".zip"


class ArchiveError(Exception):
    """An archive whose central directory cannot be read: none of its members can be."""


@dataclasses.dataclass(frozen=True)
class Member:
    name: str             # the name inside the archive
    relpath: str          # the dataset path it stands for (or `<archive>::<name>` when unsafe)
    uri: str              # zip://<name>::<archive URI>
    size: int             # uncompressed bytes
    compress_size: int
    crc: int              # CRC-32 from the central directory
    date_time: tuple
    error: str | None     # why it cannot be used (unsafe name, encrypted), else None

    @property
    def version(self) -> str:
        """The member's own identity (CRC-32 and timestamp), not the archive's: re-uploading
        an archive, or adding a member to it, leaves the other members' cached volumes valid."""
        y, mo, d, h, mi, s = self.date_time
        return f"zip crc32:{self.crc:08x} {y:04d}-{mo:02d}-{d:02d}T{h:02d}:{mi:02d}:{s:02d}"


def is_archive(path: str) -> bool:
    return str(path).lower().endswith(SUFFIX)


def member_relpath(archive_rel: str, name: str) -> str:
    """The dataset path a member stands for, or PathEscapeError for names that would leave
    the archive's folder (zip slip). Backslashes, which some Windows tools write, count as
    separators, as unzip and 7-Zip treat them."""
    if "::" in name:
        raise fsio.PathEscapeError(f"member name {name!r} contains '::' (reserved for URIs)")
    rel = fsio.safe_relpath(name.replace("\\", "/"))
    folder = posixpath.dirname(archive_rel)
    return posixpath.join(folder, rel) if folder else rel


@contextlib.contextmanager
def open_archive(archive_uri: str):
    """A zipfile.ZipFile over a seekable fsspec file: only the tail and the members read
    are fetched. Raises ArchiveError when the central directory cannot be read."""
    fs, path = fsio.filesystem(archive_uri)
    with fs.open(path, "rb") as f:
        try:
            zf = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, EOFError, ValueError) as exc:
            raise ArchiveError(f"corrupt archive: {archive_uri}: {exc} (no readable central directory: "
                               "truncated, or not a ZIP)") from None
        with zf:
            yield zf


def list_members(archive_uri: str, archive_rel: str) -> list[Member]:
    """Every file member of one archive (directories skipped), from its central directory."""
    try:
        with open_archive(archive_uri) as zf:
            infos = zf.infolist()
    except PermissionError as exc:
        raise ArchiveError(f"unreadable archive: {archive_uri}: {type(exc).__name__}: {exc}") from None
    except OSError as exc:  # the store, not the archive: recording it in sources.parquet would make it stick
        raise cli.JobAborted(f"could not read the archive {archive_uri} ({type(exc).__name__}: {exc}); is the "
                             "store reachable? Nothing was written: re-run `make manifest`.") from None
    out = []
    for info in infos:
        if info.is_dir():
            continue
        error = None
        try:
            rel = member_relpath(archive_rel, info.filename)
        except fsio.PathEscapeError as exc:
            rel, error = f"{archive_rel}::{info.filename}", f"bad path in archive: {exc}"
        if error is None and info.flag_bits & 0x1:
            error = "unreadable: encrypted ZIP member (passwords are not supported)"
        out.append(Member(name=info.filename, relpath=rel, uri=fsio.member_uri(archive_uri, info.filename),
                          size=info.file_size, compress_size=info.compress_size, crc=info.CRC,
                          date_time=tuple(info.date_time), error=error))
    return out


def list_archives(root: str, rels: list[str], workers: int = 8) -> dict[str, tuple[list[Member], str | None]]:
    """archive relpath -> (members, None) or ([], reason), for archives under `root`. In
    threads: on gs:// each central directory costs a few round trips."""
    def one(rel: str):
        try:
            return rel, (list_members(fsio.join(root, rel), rel), None)
        except ArchiveError as exc:
            return rel, ([], str(exc))

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(one, rels))


def read_failure(exc: BaseException, uri: str = "") -> str | None:
    """The failed-row reason for an exception raised while reading a ZIP member, or None
    when the exception is not an archive problem."""
    where = fsio.split_member_uri(uri)
    archive = f"{posixpath.basename(where[0])}: " if where else ""
    if isinstance(exc, zipfile.BadZipFile):
        if "CRC" in str(exc):
            return f"bad CRC: {archive}{exc}: the member's bytes differ from the CRC-32 the archive recorded"
        return f"corrupt archive: {archive}{exc}"
    if isinstance(exc, (zlib.error, EOFError)):
        return f"corrupt archive: {archive}{type(exc).__name__}: {exc}"
    if where and isinstance(exc, NotImplementedError):
        return f"unsupported ZIP member: {archive}{exc}"
    if where and isinstance(exc, RuntimeError) and "encrypted" in str(exc):
        return "unreadable: encrypted ZIP member (passwords are not supported)"
    return None


def first_source_wins(members: list, holder: str, seen: dict[str, str]) -> tuple[list, list[tuple]]:
    """The one rule for a path two sources hold: the first keeps it (plain files first, then
    archives in sorted order). Returns this archive's members no earlier source holds, and the
    rest as (member, who holds its path); `seen` (path -> holder) learns the kept ones."""
    keep, dups = [], []
    for m in members:
        if m.relpath in seen:
            dups.append((m, seen[m.relpath]))
        else:
            seen[m.relpath] = holder
            keep.append(m)
    return keep, dups
