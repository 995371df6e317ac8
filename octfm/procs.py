"""The one way this project starts worker processes: the cohort writer's and the cache build's
pools, the training loaders, and jobs each in a process of its own (`in_processes`: the learning
check's references, fine-tuning runs and probe fits at once).

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
import subprocess
import multiprocessing.connection
import resource
import sys
import time
import traceback
from multiprocessing import forkserver
from typing import Sequence

HEAVY = ("torch", "cache.worker", "train.data", "monai.transforms")  # torch, zarr, pydicom, numpy, the crops
OURS = ("bench", "cache", "check", "evals", "ingest", "manifests", "octfm", "train")  # packages whose modules guard main()


def preload_modules(base: Sequence[str] = HEAVY) -> list[str]:
    """`base` (the heavy modules unless a pool asks for fewer) and, when the program is one of
    our `python -m` modules, the modules of ours it has imported so far, but never the main
    module itself (not even from `base`): a worker runs the main module
    again as `__mp_main__` (runpy), which then finds its imports loaded; had the server imported
    the main module by its name, runpy warns in every worker that it found it in sys.modules
    (an earlier preload did: 15 warnings a loader on the H200) and the worker runs it anyway.
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


def cpu_seconds() -> float:
    """CPU seconds of this process and its waited-for children so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def in_processes(jobs: dict, width: int, ended=None, threads: int = 0) -> dict:
    """{name: result} of each named job, (a module-level function, its arguments), each in its
    own process, `width` at a time, started in the order given, each on `threads` torch threads
    (0: torch's default); `ended(name, wall s, cpu s)` as each one ends. A failure, or Ctrl-C,
    is raised at once: the queued jobs do not start and the running ones are ended, not waited for
    (a supervised reference runs tens of minutes; a pool's shutdown would wait for it)."""
    ctx = worker_context()
    queued, running, out = list(jobs.items()), {}, {}
    try:
        while queued or running:
            while queued and len(running) < width:
                name, (fn, args) = queued.pop(0)
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_job, args=(send, threads, fn, args), name=f"octfm-job {name}")
                proc.start()
                send.close()
                running[recv] = (name, proc)
            for recv in multiprocessing.connection.wait(list(running)):
                name, proc = running.pop(recv)
                out[name], wall, cpu = _job_result(name, recv, proc)
                if ended:
                    ended(name, wall, cpu)
    finally:
        for _, proc in running.values():
            proc.terminate()
        for _, proc in running.values():
            proc.join()
    return {name: out[name] for name in jobs}


def _job(send, threads: int, fn, args) -> None:
    """A job's process: _timed(threads, fn, *args) sent back as (True, result) or, raised, (False,
    the exception with its traceback in a note)."""
    try:
        result = (True, _timed(threads, fn, *args))
    except BaseException as exc:  # noqa: BLE001 - re-raised by the parent (in_processes)
        exc.add_note("in the job's process:\n" + "".join(traceback.format_exception(exc)))
        result = (False, exc)
    try:
        send.send(result)
    except Exception as exc:  # noqa: BLE001 - the result or the exception does not pickle
        what = "result" if result[0] else f"exception ({result[1]!r})"
        send.send((False, RuntimeError(f"{getattr(fn, '__name__', fn)}: its {what} could not be sent back: "
                                       f"{type(exc).__name__}: {exc}")))


def _job_result(name: str, recv, proc) -> tuple:
    """A finished job's (result, wall s, cpu s); its exception raised; a process that died without
    an answer said."""
    try:
        ok, value = recv.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"{name}: its process ended without a result (exit status {proc.exitcode}; out of "
                           "memory?)") from None
    proc.join()
    if not ok:
        raise value
    return value


def call_job(job: tuple):
    """A job, (a module-level function, its arguments), run here."""
    fn, args = job
    return fn(*args)


def _timed(threads: int, fn, *args):
    """fn(*args) in a job's process on `threads` torch threads (0: as it is), with its wall and
    CPU seconds."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    t0, c0 = time.perf_counter(), cpu_seconds()
    out = fn(*args)
    return out, round(time.perf_counter() - t0, 1), round(cpu_seconds() - c0, 1)


def git_commit(repo) -> str | None:
    """The checkout's short HEAD, with `+` where tracked files have changes beside it; None outside a
    clone (an installed package) or without git."""
    try:
        run = [["git", "-C", str(repo), *args] for args in (("rev-parse", "--short", "HEAD"),
                                                             ("status", "--porcelain", "--untracked-files=no"))]
        commit, dirty = (subprocess.run(c, capture_output=True, text=True, timeout=10).stdout.strip() for c in run)
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+" if dirty else "")) if commit else None
