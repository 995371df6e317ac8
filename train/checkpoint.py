"""Checkpoints: atomic, local or gs://, loadable with torch.load(weights_only=True).

Everything is stored as tensors and plain Python data (RNG states included), so the safe
loader accepts it and a checkpoint with a pickled object is refused. Every file carries its
`format` (FORMAT); one without it was written before octfm's v1 cut and is refused, naming the
git tag whose code reads it (train/config.py before_v1).

A save writes one file, step_<N>.pt, and then the pointer latest.txt naming it: the path
`<ckpt_dir>/latest.pt` that users pass resolves through the pointer (`resolve_latest`), so the
newest state is on disk once, not twice.

"Newest" has one meaning everywhere: the last written, which is the file the pointer names.
latest.txt holds the write log (the pointed name first, then earlier saves, newest first), so
automatic resume, `make probe`, the lockout message and the learning check agree with latest.pt
after a run resumed from an older step, and pruning goes by write order, never by step number.
One exception: a step file the log does not hold and that was written after the pointer (a save
killed between its two writes) is newer than the pointer.
"""
from __future__ import annotations

import io
import pickle
import posixpath
import random
import re
import threading
import zipfile

import numpy as np
import torch

from octfm import fsio
from octfm.cli import JobAborted, UsageError
from octfm.config import ConfigError
from train.config import before_v1  # the one message for a file from before the v1 cut

STEP_RE = re.compile(r"step_(\d+)\.pt$")
LATEST = "latest.pt"    # the name users pass for a run's newest checkpoint
POINTER = "latest.txt"  # what save writes instead of a copy: the newest step file's name
FORMAT = 2              # every checkpoint's `format`; the files written before the v1 cut have none


def require_shared(ckpt_dir: str, hosts: int, key: str = "ckpt_dir") -> None:
    """A run on several hosts keeps its checkpoints where every host sees them: each host resumes
    from the same file after a restart (a local folder would resume host 0 alone while the
    others start from step 0, and the replicas part or hang). `key`: the config key that names
    the folder (fine-tuning's is `out`)."""
    if hosts > 1 and not fsio.is_shared(ckpt_dir):
        kind = fsio.mount_type(ckpt_dir)
        raise ConfigError(
            f"{key}: {ckpt_dir} is a local folder ({kind or 'unknown'} file system), but this run spans {hosts} "
            f"hosts: each would resume from its own copy. Set {key}=gs://<bucket>/<path> (or a folder on a file "
            f"system every host mounts: {', '.join(sorted(fsio.SHARED_FILESYSTEMS))})")


def rng_state() -> dict:
    np_state = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "python": list(internal) + [version, gauss]}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    p = state["python"]
    random.setstate((p[-2], tuple(p[:-2]), p[-1]))


def step_uri(ckpt_dir: str, step: int) -> str:
    return fsio.join(ckpt_dir, f"step_{step:07d}.pt")


def resolve_latest(uri: str) -> str:
    """The file a checkpoint path names: `<dir>/latest.pt` is the step file that
    `<dir>/latest.txt` names (what save writes); a run (a local run folder, or a gs:// one as a
    TPU run leaves it: train/run_folder.py) names its latest.pt; any other path is itself. Every
    reader goes through here, so latest.pt and a run work wherever a checkpoint is accepted."""
    uri = str(uri).rstrip("/")
    if not uri.endswith(".pt") and _is_folder(uri):
        from train import run_folder

        return resolve_latest(fsio.join(run_folder.checkpoint_dir(uri), LATEST))
    if posixpath.basename(uri) != LATEST:
        return uri
    folder = posixpath.dirname(uri)
    log = write_log(folder)
    return fsio.join(folder, log[0]) if log else uri  # neither: the reader says latest.pt is missing


def _is_folder(uri: str) -> bool:
    fs, path = fsio.filesystem(uri)
    return fs.isdir(path)


def write_log(ckpt_dir: str) -> list[str]:
    """The step files' names in write order, newest first, as latest.txt records them; [] without
    a pointer."""
    pointer = fsio.join(ckpt_dir, POINTER)
    try:
        names = [ln.strip() for ln in fsio.read_text(pointer).splitlines() if ln.strip()]
    except FileNotFoundError:
        return []
    for name in names:
        if not STEP_RE.fullmatch(name):
            raise ValueError(f"{pointer}: names {name!r}, not a step_<N>.pt file of its folder")
    return names


def _store_time(info: dict):
    """A store's modification time from an fsspec info (local mtime, GCS updated, S3
    LastModified), else the object generation; None where it has none."""
    return info.get("mtime") or info.get("updated") or info.get("LastModified") or info.get("generation")


def _write_time(info: dict) -> float:
    """`_store_time` as seconds, for ordering writes."""
    value = _store_time(info) or 0
    if hasattr(value, "timestamp"):
        return value.timestamp()
    if isinstance(value, str):
        import datetime

        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return float(value)


def write_order(ckpt_dir: str) -> list[str]:
    """The step files present, newest write first: any the log does not hold but written after
    the pointer (a save killed before it pointed), then the log's, then the others (a folder
    whose first save was killed before it pointed) by step number."""
    fs, base = fsio.filesystem(ckpt_dir)
    if not fs.exists(base):
        return []
    infos = {posixpath.basename(i["name"]): i for i in fs.ls(base, detail=True)}
    present = sorted((n for n in infos if STEP_RE.fullmatch(n)), key=lambda n: int(STEP_RE.fullmatch(n).group(1)),
                     reverse=True)
    log = [n for n in write_log(ckpt_dir) if n in infos]
    unlogged = [n for n in present if n not in log]
    pointer_time = _write_time(infos[POINTER]) if POINTER in infos else float("-inf")
    after = [n for n in unlogged if _write_time(infos[n]) > pointer_time] if log else []
    return after + log + [n for n in unlogged if n not in after]


def candidates(ckpt_dir: str) -> list[str]:
    """Checkpoints to resume or probe from, newest first (`write_order`)."""
    return [fsio.join(ckpt_dir, n) for n in write_order(ckpt_dir)]


def _following_pointer(uri: str, read):
    """read(resolved path), following latest.pt's pointer again when the file it named was
    pruned between resolving and reading (another process saved and pruned meanwhile)."""
    path = resolve_latest(uri)
    for _ in range(4):
        try:
            return read(path)
        except FileNotFoundError:
            again = resolve_latest(uri)
            if again == path:  # not a pointer that moved on: the file is missing
                raise
            path = again
    return read(path)


def identity(uri: str) -> dict:
    """Name, size and modification time (or object generation): a checkpoint re-saved at the
    same step (a resumed run) reads as new; one moved or copied with its times does not.
    latest.pt is identified as the step file it resolves to."""
    def info_of(resolved: str):
        fs, p = fsio.filesystem(resolved)
        return p, fs.info(p)

    path, info = _following_pointer(uri, info_of)
    return {"name": posixpath.basename(path), "size": int(info.get("size") or 0), "modified": str(_store_time(info))}


def to_cpu(obj):
    """A state dict tree with every tensor copied to the CPU (checkpoints load on any device).
    Always a copy, a CPU tensor too (.cpu() would return that very tensor): a checkpoint is
    written in the background while training changes its tensors in place."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def write(state: dict, uri: str) -> None:
    """One checkpoint file at `uri`, atomically (e.g. a fine-tuning run's best.pt), with its
    `format`. Encoded straight into the file: no second copy of the state in memory."""
    with fsio.atomic_writer(uri) as f:
        torch.save({"format": FORMAT, **state}, f)


def save(state: dict, ckpt_dir: str, step: int, keep_last: int | None = None) -> str:
    """Write step_<N>.pt atomically, then point latest at it (`point_latest`), keeping the
    keep_last most recently written step files."""
    path = step_uri(ckpt_dir, step)
    write(state, path)
    point_latest(ckpt_dir, path, keep_last)
    return path


def point_latest(ckpt_dir: str, path: str, keep_last: int | None = None) -> None:
    """latest.txt names `path` first, then the earlier saves kept (the write log), atomically;
    then the step files beyond keep_last in write order are deleted (never the pointed one, and
    only after the pointer stops naming them)."""
    name = posixpath.basename(path)
    log = [name] + [n for n in write_order(ckpt_dir) if n != name]
    kept, dropped = (log[:keep_last], log[keep_last:]) if keep_last else (log, [])
    fsio.atomic_write_bytes(fsio.join(ckpt_dir, POINTER), ("\n".join(kept) + "\n").encode())
    for old in dropped:
        fs, p = fsio.filesystem(fsio.join(ckpt_dir, old))
        fs.rm(p)


def list_steps(ckpt_dir: str) -> list[int]:
    fs, base = fsio.filesystem(ckpt_dir)
    if not fs.exists(base):
        return []
    return sorted(int(m.group(1)) for p in fs.ls(base, detail=False) if (m := STEP_RE.search(posixpath.basename(p))))


def load(uri: str, map_location="cpu") -> dict:
    """torch.load with weights_only=True: tensors and plain data only (latest.pt: `resolve_latest`);
    a file without this FORMAT is refused (UsageError: not damage, which readers skip)."""
    return load_named(uri, map_location)[1]


def load_named(uri: str, map_location="cpu") -> tuple[str, dict]:
    """`load`, with the file it read (latest.pt resolved once): a reader that also records the
    checkpoint's `identity` takes it of that file, not of the one latest.pt names after a save
    that landed meanwhile."""
    path, data = _following_pointer(uri, lambda resolved: (resolved, fsio.read_bytes(resolved)))
    state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(before_v1(f"{path}: a checkpoint (no format {FORMAT})"))
    return path, state


def is_whole(uri: str) -> bool:
    """A torch checkpoint is a ZIP whose directory sits at the end: a file cut short has lost
    it. Reads only the tail, so commands that load a checkpoint later can pick one cheaply."""
    def whole(resolved: str) -> bool:
        fs, path = fsio.filesystem(resolved)
        try:
            with fs.open(path, "rb") as f, zipfile.ZipFile(f):
                return True
        except (zipfile.BadZipFile, EOFError, ValueError):
            return False

    return _following_pointer(uri, whole)


def newest_whole(ckpt_dir: str, warn=print) -> str | None:
    """The newest step file (write_order) that is whole, warning about the ones skipped; None
    when there is none."""
    def scan() -> str | None:
        for uri in candidates(ckpt_dir):
            if is_whole(uri):
                return uri
            warn(f"warning: checkpoint {uri} is cut short (no ZIP directory); trying the one before it")
        return None

    return _rescanned(ckpt_dir, scan)


def load_newest_good(ckpt_dir: str, map_location="cpu", warn=print) -> tuple[str, dict] | None:
    """The newest checkpoint that reads back whole, newest write first.

    A file cut short (a crash mid-copy, a full disk under another writer) is skipped with a
    warning naming it. A refused pickle or format is not skipped: that is an error, not wear. A file pruned
    while we read (another process saved meanwhile) sends us back to the new newest.
    """
    def scan() -> tuple[str, dict] | None:
        tried = candidates(ckpt_dir)
        for uri in tried:
            try:
                return uri, load(uri, map_location)
            except pickle.UnpicklingError:
                raise
            except (RuntimeError, EOFError, zipfile.BadZipFile) as exc:  # not OSError: a network error is not damage
                warn(f"warning: checkpoint {uri} is unreadable ({type(exc).__name__}: {str(exc)[:120]}); "
                     "trying the one before it")
        if tried:  # starting over would overwrite the run's checkpoints
            raise RuntimeError(f"no checkpoint in {ckpt_dir} reads back whole ({len(tried)} tried); "
                               "move them aside to start over, or pass CKPT=...")
        return None

    return _rescanned(ckpt_dir, scan)


RESCANS = 3  # passes over a checkpoint folder whose files another process prunes while we read


def _rescanned(ckpt_dir: str, scan):
    """scan() of the folder's checkpoints, again when a file it read disappeared meanwhile (another
    process saved and pruned), at most RESCANS times. Files that keep disappearing, or that
    disappear for good, are said as such: not as damage to move aside, and not as "no checkpoint"
    (a resume would start the run afresh beside them)."""
    gone = None
    for _ in range(RESCANS):
        try:
            found = scan()
        except FileNotFoundError as exc:
            gone = exc
            continue
        if found is not None or gone is None:
            return found
        break
    raise JobAborted(f"the checkpoints in {ckpt_dir} disappeared while they were being read ({RESCANS} passes; the "
                     f"last gone: {gone.filename or gone}): another process is saving and pruning them (a second run "
                     "on this folder?) or moving them; run again once it is done, or pass CKPT=<a step file>")


class Writer:
    """Saves on a thread of its own, one at a time, so training goes on while a state (about
    1.5 GB at ViT-B) is encoded and written. The state handed over must be a copy training
    cannot change (to_cpu). A write's error is raised, naming its file, by the
    next submit, poll or wait; `done(path)` runs on the caller's thread once the file exists."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._path, self._done, self._error = None, None, None

    def submit(self, state: dict, ckpt_dir: str, step: int, keep_last: int | None = None, done=None) -> str:
        """Wait for the write in flight, then start `save` of this state; the path it writes."""
        self.wait()
        self._path, self._done, self._error = step_uri(ckpt_dir, step), done, None

        def work() -> None:
            try:
                save(state, ckpt_dir, step, keep_last)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread by wait
                self._error = exc

        self._thread = threading.Thread(target=work, name="octfm-checkpoint")  # not a daemon: exit waits for it
        self._thread.start()
        return self._path

    def poll(self) -> None:
        """Finish a write that has ended (its error raised, `done` called); never blocks."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> str | None:
        """Block until the write in flight is down; its path, or None when there was none."""
        if self._thread is None:
            return None
        self._thread.join()
        path, done, error = self._path, self._done, self._error
        self._thread, self._path, self._done, self._error = None, None, None, None
        if error is not None:
            raise RuntimeError(f"checkpoint {path}: the background write failed: "
                               f"{type(error).__name__}: {error}") from error
        if done is not None:
            done(path)
        return path
