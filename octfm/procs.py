"""The one way this project starts worker processes: the cohort writer's and the cache build's
pools, and the training loaders.

forkserver, not fork: a caller may hold torch's threads or zarr's event loop, and zarr 3
deadlocks in children forked from a process whose loop is running (spawn where forkserver is
missing). The server is started once per process, by whichever pool or loader comes first, and
it preloads our heavy modules and what the running program's main module imported. Without
that, each new worker imports the main module's imports again before it reads its job, and the parent's write of a job
larger than a pipe's buffer (a loader's dataset) waits for it, so the workers start one after
another: the first batch of the GPU-size learning check waited 89 s for its 15 loader workers on
an H200 (docs/accelerators.md).
"""
from __future__ import annotations

import multiprocessing as mp
import sys
from multiprocessing import forkserver
from typing import Sequence

HEAVY = ("torch", "cache.worker", "train.data", "monai.transforms")  # torch, zarr, pydicom, numpy, the crops
OURS = ("bench", "cache", "evals", "ingest", "manifests", "octfm", "train")  # packages whose modules guard main()


def preload_modules(base: Sequence[str] = HEAVY) -> list[str]:
    """`base` (the heavy modules unless a pool asks for fewer) and, when the program is one of
    our `python -m` modules, the modules of ours it has imported so far, but never the main
    module itself (not even from `base`): a worker runs the main module
    again as `__mp_main__` (runpy), which then finds its imports loaded; had the server imported
    the main module by its name, runpy warns in every worker that it found it in sys.modules
    (stop 49's preload did, 15 warnings a loader on the H200) and the worker runs it anyway.
    Other `-m` mains are left out (`pytest.__main__`'s imports are not ours). A main script run
    by its path is not helped: the standard library's server start passes no `main_path`
    (Python 3.11 and 3.12), so each worker runs such a script itself, one after another (ours
    are all run with `-m`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or ""
    if name.split(".")[0] not in OURS or name.endswith("__main__"):
        return list(base)
    return [*(m for m in base if m != name),
            *sorted(m for m in list(sys.modules) if m.split(".")[0] in OURS and m != name and m not in base)]


def worker_context(start_method: str = "forkserver", preload: Sequence[str] = HEAVY):
    """The multiprocessing context for `start_method` ("forkserver" or "spawn"). For forkserver
    the server is started here with the preloads (where this process has none running yet): it
    imports them while the caller goes on, and the first worker waits only for what is left.
    `preload`: fewer modules for pools whose workers need no MONAI or trainer (the cache build,
    the cohort writer: about 3 s less to start on 2 cores, docs/measurements.md "Starting a
    worker pool"), honoured only while this process has not imported torch itself: a program
    that has (the learning check, a test run) will start loaders later, and its one server
    keeps the heavy list. A server started with fewer is replaced when a heavy pool comes."""
    if start_method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        _serve(server_modules(preload))
        return ctx
    return mp.get_context("spawn")


def server_modules(preload: Sequence[str]) -> list[str]:
    """What a server started now for a pool asking `preload` imports (worker_context)."""
    return preload_modules(HEAVY if "torch" in sys.modules else preload)


_served: set[str] | None = None  # the modules this process's server was started with here


def _serve(modules: list[str]) -> None:
    """Start the process server with `modules` preloaded, or keep the running one. One started
    with fewer than HEAVY lacks the trainer's modules: its loader workers would each import
    them while the parent's write of their job waits (the H200's 89-s first batch), so it is
    stopped (between stages, its pool's workers gone) and a heavy one started."""
    global _served
    server = forkserver._forkserver
    if _served is not None and not set(HEAVY) <= _served and set(HEAVY) <= set(modules):
        server._stop()  # private, but in 3.11-3.13: the only way to change a running server's preloads
        _served = None
    if _served is None:
        server.set_forkserver_preload(modules)
        _served = set(modules)
    server.ensure_running()
