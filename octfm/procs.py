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

HEAVY = ("torch", "cache.worker", "train.data", "monai.transforms")  # torch, zarr, pydicom, numpy, the crops
OURS = ("bench", "cache", "evals", "ingest", "manifests", "octfm", "train")  # packages whose modules guard main()


def preload_modules() -> list[str]:
    """The heavy modules and, when the program is one of our `python -m` modules, the modules of
    ours it has imported so far, but not the main module itself: a worker runs the main module
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
        return list(HEAVY)
    return [*HEAVY, *sorted(m for m in list(sys.modules) if m.split(".")[0] in OURS and m != name and m not in HEAVY)]


def worker_context(start_method: str = "forkserver"):
    """The multiprocessing context for `start_method` ("forkserver" or "spawn"). For forkserver
    the server is started here with the preloads (where this process has none running yet): it
    imports them while the caller goes on, and the first worker waits only for what is left."""
    if start_method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(preload_modules())
        forkserver.ensure_running()
        return ctx
    return mp.get_context("spawn")
