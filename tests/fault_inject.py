"""Run a stage entry with a fault injected at an exact moment, the way a crash would hit it.

    python tests/fault_inject.py --kill-at-fsync step_0000010.pt -m train.pretrain ...

`--kill-at-fsync NAME`: when the process fsyncs a temp file whose name contains NAME (the
moment an atomic write has its bytes down but has not renamed yet), it sends itself SIGKILL.
The code under test is not changed; only os.fsync is wrapped in this process.
"""
from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys


def kill_at_fsync(name: str) -> None:
    real_fsync = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if name in os.path.basename(path):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_fsync(fd)

    os.fsync = fsync


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kill-at-fsync", required=True)
    ap.add_argument("-m", dest="module", required=True)
    args, rest = ap.parse_known_args()
    kill_at_fsync(args.kill_at_fsync)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo, as with -m
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
