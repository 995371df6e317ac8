"""fsio.pid_lock: the lock that keeps two builders off one cache shard and two
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


ROUNDS = 5


def _contend(locks: str, ready, go, done, start_at, held, wins) -> None:
    """One contender for every round: all four take over round r's stale lock at one instant (each
    asleep until just before it, then spinning), the parent between rounds. Spawned once: a spawn costs
    the interpreter's start, which five rounds of four paid ten seconds for on 2 cores."""
    ready.wait()
    for r in range(ROUNDS):
        go.wait()
        start = start_at.value
        time.sleep(max(0.0, start - time.time() - 0.005))
        while time.time() < start:
            pass
        try:
            with fsio.pid_lock(f"{locks}{r}", on_stale=lambda m: None):
                with held.get_lock():
                    held.value += 1
                    if held.value > 1:
                        wins[r] = -100  # two holders at once
                time.sleep(0.05)
                with held.get_lock():
                    held.value -= 1
                    wins[r] += 1
        except fsio.Busy:
            pass
        done.wait()


def test_concurrent_takeovers_of_a_stale_lock_leave_one_holder(tmp_path):
    ctx = mp.get_context("spawn")
    held, wins = ctx.Value("i", 0), ctx.Array("i", ROUNDS)
    ready, go, done, start_at = ctx.Barrier(5), ctx.Barrier(5), ctx.Barrier(5), ctx.Value("d", 0.0)
    procs = [ctx.Process(target=_contend, args=(str(tmp_path / ".lock"), ready, go, done, start_at, held, wins))
             for _ in range(4)]
    for p in procs:
        p.start()
    try:
        ready.wait(60)                                          # every contender is up
        for round_ in range(ROUNDS):
            (tmp_path / f".lock{round_}").write_text("999999999")  # a pid that is gone
            start_at.value = time.time() + 0.2                  # read once the barrier lets them all go
            go.wait(60)
            done.wait(60)
            assert wins[round_] >= 1, f"round {round_}: two holders at once, or none"
    finally:
        for barrier in (ready, go, done):  # a failed round: the contenders leave their waits and end
            barrier.abort()
        for p in procs:
            p.join(30)
