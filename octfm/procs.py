"""The one way this project starts worker processes: the cohort writer's and the cache build's
pools, and the training loaders.

forkserver, not fork: a caller may hold torch's threads or zarr's event loop, and zarr 3
deadlocks in children forked from a process whose loop is running (spawn where forkserver is
missing). The server is started once per process, by whichever pool or loader comes first, and
it preloads our heavy modules and the running program's main module. Without that, each new
worker imports the main module again before it reads its job, and the parent's write of a job
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
    """The heavy modules and the main module when it is one of our `python -m` modules, by its
    name (imported as a module: its main() is guarded; a worker's own run of it as `__mp_main__`
    then finds its imports loaded). Other `-m` mains are left out (`pytest.__main__` would run).
    A main script run by its path is not preloaded: the standard library's server start passes
    no `main_path` (Python 3.11 and 3.12), so its `'__main__'` entry does nothing; each worker
    runs such a script itself, one after another (ours are all run with `-m`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "")
    ours = name.split(".")[0] in OURS and not name.endswith("__main__")
    return [*HEAVY, *([name] if ours else [])]


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
