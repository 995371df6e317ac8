"""fsio.pid_lock (issue 40, item 2): the lock that keeps two builders off one cache shard and two
`make embed` runs off one table. It must be held by one process at a time, also in the moment
between a holder creating the file and writing its pid, and when two processes take over a
killed holder's lock at once."""
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

from octfm import fsio

# a holder that has the lock file open and locked but has not written its pid yet
HOLD_EMPTY = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
time.sleep(30)
"""


def test_a_lock_file_without_a_pid_yet_is_not_taken_for_stale(tmp_path):
    lock = tmp_path / ".lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_EMPTY, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lock.read_text() == ""  # the window: created, no pid written
        with pytest.raises(fsio.Busy, match="is held by"):
            with fsio.pid_lock(lock, on_stale=lambda m: None):
                pass
        assert lock.exists()  # the holder's file is left alone
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holders_lock_is_taken_over_and_says_so(tmp_path):
    lock = tmp_path / ".lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(dead.stdout.strip())  # what a killed holder leaves: its pid, no process
    said = []
    with fsio.pid_lock(lock, on_stale=said.append):
        assert lock.read_text() == str(os.getpid())
    assert said and dead.stdout.strip() in said[0] and "gone" in said[0]
    assert not lock.exists()


def _contend(lock: str, start: float, held, wins) -> None:
    while time.time() < start:
        pass
    try:
        with fsio.pid_lock(lock, on_stale=lambda m: None):
            with held.get_lock():
                held.value += 1
                if held.value > 1:
                    wins.value = -100  # two holders at once
            time.sleep(0.05)
            with held.get_lock():
                held.value -= 1
            wins.value += 1
    except fsio.Busy:
        pass


def test_concurrent_takeovers_of_a_stale_lock_leave_one_holder(tmp_path):
    ctx = mp.get_context("spawn")
    for round_ in range(5):
        lock = tmp_path / f".lock{round_}"
        lock.write_text("999999999")  # a pid that is gone
        held, wins = ctx.Value("i", 0), ctx.Value("i", 0)
        start = time.time() + 1.5
        procs = [ctx.Process(target=_contend, args=(str(lock), start, held, wins)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        assert wins.value >= 1, f"round {round_}: two holders at once, or none"
