"""One way to reach local folders and gs:// buckets (fsspec), with atomic writes.

Why: every stage reads or writes both kinds of location; the emulator used in tests and
real GCS differ only in environment (STORAGE_EMULATOR_HOST), never in code paths.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import posixpath
import shutil
import tempfile
import threading
import uuid
from pathlib import Path

import fsspec


_UMASK = os.umask(0o022)  # read once at import (os.umask sets it too, so put it back at once)
os.umask(_UMASK)


class PathEscapeError(ValueError):
    """A manifest path that would leave the dataset root."""


def is_remote(uri: str) -> bool:
    return "://" in str(uri) and not str(uri).startswith("file://")


# File systems that every machine mounting them sees alike (network and cluster file systems,
# bucket mounts); a local disk under the same path on each host is not one of them.
SHARED_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "lustre", "ceph", "fuse.ceph", "glusterfs", "fuse.glusterfs", "beegfs",
    "gpfs", "fuse.gcsfuse", "fuse.s3fs", "fuse.mountpoint-s3", "fuse.juicefs", "fuse.blobfuse2"})


def mount_type(path: str, mounts: str = "/proc/self/mounts") -> str | None:
    """The file-system type of the mount that holds `path` (which need not exist yet), from the
    mount table; None where the table cannot be read."""
    head, rest = os.path.abspath(path), []
    while not os.path.exists(head) and head != os.path.dirname(head):  # links resolved where the path exists
        head, tail = os.path.split(head)
        rest.insert(0, tail)
    p = os.path.join(os.path.realpath(head), *rest)
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = p == point or p.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def is_shared(uri: str, mounts: str = "/proc/self/mounts") -> bool:
    """Whether every host of a run reads and writes `uri` alike: an object store (gs://, s3://),
    or a local path on a network or cluster file system (SHARED_FILESYSTEMS)."""
    if is_remote(uri):
        return True
    return mount_type(str(uri), mounts) in SHARED_FILESYSTEMS


def storage_options(uri: str) -> dict:
    """Options for fsspec: on gs://, anonymous access when an emulator is configured."""
    if str(uri).startswith(("gs://", "gcs://")):
        opts: dict = {}
        host = os.environ.get("STORAGE_EMULATOR_HOST")
        if host:
            opts["token"] = "anon"
            opts["endpoint_url"] = host if host.startswith("http") else f"http://{host}"
        elif os.environ.get("OCTFM_GCS_TOKEN"):
            opts["token"] = os.environ["OCTFM_GCS_TOKEN"]
        return opts
    return {}


def member_uri(archive_uri: str, member: str) -> str:
    """fsspec's chained URL for a member of a ZIP archive (local or remote archive).

    `zip://1001/x.dcm::gs://bucket/ds/.../part1.zip`: opening it reads the archive's central
    directory and that member's bytes by range, never the whole archive.
    """
    return f"zip://{member}::{archive_uri}"


def split_member_uri(uri: str) -> tuple[str, str] | None:
    """(archive URI, member name) of a `zip://member::archive` URI, else None."""
    uri = str(uri)
    if not uri.startswith("zip://") or "::" not in uri:
        return None
    member, archive = uri.removeprefix("zip://").split("::", 1)
    return archive, member


def filesystem(uri: str):
    """(fs, path) for a local path, a URL, or a ZIP member URL (`zip://member::archive`)."""
    uri = str(uri)
    if not is_remote(uri):
        return fsspec.filesystem("file"), os.path.abspath(uri.removeprefix("file://"))
    chained = split_member_uri(uri)
    if chained:  # options belong to the archive's file system, keyed by its protocol
        archive = chained[0]
        protocol = archive.split("://", 1)[0] if is_remote(archive) else "file"
        return fsspec.core.url_to_fs(uri, **{protocol: storage_options(archive)})
    fs, path = fsspec.core.url_to_fs(uri, **storage_options(uri))
    return fs, path


def join(root: str, *parts: str) -> str:
    root = str(root)
    if is_remote(root):
        return posixpath.join(root.rstrip("/"), *parts)
    return os.path.join(root, *parts)


def safe_relpath(rel: str, required_prefix: str | None = None) -> str:
    """Normalise a manifest path to a relative POSIX path inside the root, or raise.

    AI-READI writes paths like `/retinal_oct/...` meaning relative to the dataset root: one
    leading slash is accepted. URLs, `..` that climbs out, backslashes and NULs are refused.
    """
    if rel is None or str(rel).strip() == "":
        raise PathEscapeError("empty path")
    s = str(rel).strip()
    if "://" in s or s.startswith("gs:") or "\\" in s or "\x00" in s:
        raise PathEscapeError(f"path {s!r} is not inside the dataset root")
    if s.startswith("//"):
        raise PathEscapeError(f"path {s!r} is not inside the dataset root")
    s = s.removeprefix("/")
    norm = posixpath.normpath(s)
    if norm.startswith("../") or norm == ".." or norm.startswith("/") or norm == ".":
        raise PathEscapeError(f"path {rel!r} leaves the dataset root")
    if required_prefix and not (norm + "/").startswith(required_prefix.rstrip("/") + "/"):
        raise PathEscapeError(f"path {rel!r} is outside {required_prefix.rstrip('/')}/")
    return norm


def read_bytes(uri: str, timeout: float | None = None) -> bytes:
    """The whole object. `timeout` (seconds; object stores and ZIP members) bounds the call
    including the client's own retries, which otherwise wait minutes, or for ever, on a store
    that has gone away; it raises a TimeoutError (an OSError)."""
    archive = split_member_uri(uri)
    if timeout and archive and is_remote(archive[0]):  # opening the archive reads from the store too
        return _with_deadline(lambda: read_bytes(uri), timeout, uri)
    fs, path = filesystem(uri)
    if timeout and getattr(fs, "async_impl", False):
        return fs.cat_file(path, timeout=timeout)
    return fs.cat_file(path)


def is_disk_full(exc: BaseException) -> bool:
    """No space (or quota) left: the environment's fault, not the file's."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _with_deadline(fn, timeout: float, what: str):
    """fn() in a daemon thread, abandoned if it overruns (it ends, or dies with the process):
    for file systems layered over a remote one, which take no timeout of their own."""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True, name="octfm-read")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout:g}s reading {what}")
    if "error" in out:
        raise out["error"]
    return out["value"]


def list_tree(root: str) -> dict[str, dict]:
    """relpath (with /) -> the store's info (size, version fields) for every file under `root`,
    from one recursive listing; {} when `root` is absent. The one tree listing of the stages."""
    fs, base = filesystem(root)
    if not fs.isdir(base):
        return {}
    base_norm = base.rstrip("/") + "/"
    out = {}
    for path, info in fs.find(base, detail=True).items():
        if info.get("type") != "directory":
            rel = path[len(base_norm):] if path.startswith(base_norm) else os.path.relpath(path, base)
            out[rel.replace(os.sep, "/")] = info
    return out


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(path)


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8-sig")


def atomic_write_bytes(uri: str, data: bytes) -> None:
    """Write so that a reader sees the old file or the whole new one, never a torn one."""
    uri = str(uri)
    if is_remote(uri):  # an object upload is atomic: a single put is enough
        fs, path = filesystem(uri)
        fs.pipe_file(path, data)
        return
    with atomic_writer(uri) as f:
        f.write(data)


@contextlib.contextmanager
def atomic_writer(uri: str):
    """A binary file to stream into; it appears at `uri` only if the block ends normally.

    Local: temp file in the same folder, fsync, rename. gs://: an object becomes visible
    only when its upload completes; on an error the upload is discarded, not finished.
    """
    uri = str(uri)
    if is_remote(uri):
        fs, path = filesystem(uri)
        f = fs.open(path, "wb")
        try:
            yield f
        except BaseException:
            f.discard()  # gcsfs cancels a multipart upload; a small one was never sent
            f.closed = True  # or fsspec would commit the partial object when it is collected
            raise
        f.close()
        return
    path = Path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual mode
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def remove_stale_temps(root: str, recursive: bool = False, tag: str | None = None) -> int:
    """Delete what atomic writes a crash interrupted under a local folder: temp files and temp
    folders (`.<name>.tmp-...`, see temp_name). With `tag`, only that writer's (one cache
    shard's), so writers running beside it keep theirs; finished .zarr volumes are not walked
    into. Object stores keep none (an unfinished upload is never visible)."""
    if is_remote(root) or not os.path.isdir(root):
        return 0
    marker = f".tmp-{tag}-" if tag else ".tmp-"
    n = 0
    for dirpath, dirnames, files in os.walk(root):
        for name in [*files, *dirnames]:
            if name.startswith(".") and marker in name:
                path = os.path.join(dirpath, name)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
                n += 1
        dirnames[:] = [d for d in dirnames if marker not in d and not d.endswith(".zarr")] if recursive else []
    return n


def write_parquet_atomic(table, uri: str) -> None:
    """Serialise a pyarrow Table to Parquet and write it atomically."""
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    atomic_write_bytes(uri, buf.getvalue())


def temp_name(name: str, tag: str = "") -> str:
    """A sibling temp name that cleanup can recognise (`.<name>.tmp-<tag>-<uuid>`)."""
    return f".{name}.tmp-{tag}-{uuid.uuid4().hex[:12]}"


class Busy(Exception):
    """Another live process holds the lock."""


@contextlib.contextmanager
def pid_lock(path: Path, on_stale=print):
    """Hold `path` (a local lock file) for the block, with `fcntl.flock`: the kernel grants it to
    one process and drops it when that process dies, so there is no moment in which a second
    process can take a live holder's lock for stale (the file is created before the pid is
    written) and no race between two takeovers of a killed holder's file. The file holds the
    holder's pid for the messages: a live holder raises Busy naming it; a dead holder's lock is
    taken over, saying so through `on_stale`. Removed on exit."""
    path = Path(path)
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise Busy(f"{path} is held by pid {pid or 'unknown'}") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder before us removed the file as we opened it: lock the new one
    try:
        old = _read_pid(fd)
        if old and old != os.getpid():
            on_stale(f"{path}: taking over the lock of pid {old}, which is gone")
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        try:
            path.unlink(missing_ok=True)  # while still locked: a waiter that opened it finds a new file
        finally:
            os.close(fd)


def _read_pid(fd: int) -> int:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0)
    except ValueError:
        return 0
