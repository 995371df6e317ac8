"""Faults injected into real runs: kills mid-save, a store that goes away, a full disk.

Each test says what was lost; the target is nothing.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_cli, tiny_train_args
from train import checkpoint

SMOKE = "configs/pretrain_smoke.yaml"


def _weights_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[part][k], b[part][k]) for part in ("model", "target") for k in a[part])


@pytest.mark.parametrize("torn", [False, True], ids=["before-rename", "torn-write"])
def test_kill_during_checkpoint_save_resumes_from_the_last_good_one(tiny_cache, tmp_path, torn):
    common = dict(max_steps=12, ckpt_every=4)
    ref = tiny_train_args(tiny_cache, tmp_path / "ref", name="r", **common)
    assert run_cli("train.pretrain", "--config", SMOKE, "--no-progress", *ref).returncode == 0
    args = tiny_train_args(tiny_cache, tmp_path / "run", name="r", **common)
    ckdir = tmp_path / "run" / "r" / "checkpoints"
    killed = subprocess.run([sys.executable, "tests/fault_inject.py", "--kill-at-fsync", "step_0000008.pt",
                             *(["--torn"] if torn else []), "-m", "train.pretrain", "--config", SMOKE,
                             "--no-progress", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert checkpoint.list_steps(str(ckdir)) == [4], "the interrupted save must not look like a checkpoint"
    assert [p for p in ckdir.iterdir() if ".tmp-" in p.name], "the kill should have left a temp file"

    r = run_cli("train.pretrain", "--config", SMOKE, "--no-progress", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and "step_0000004.pt" in r.stdout
    assert not [p for p in ckdir.iterdir() if ".tmp-" in p.name], "stale temp files are cleaned up"
    a = checkpoint.load(str(tmp_path / "ref" / "r" / "checkpoints" / "latest.pt"))
    b = checkpoint.load(str(ckdir / "latest.pt"))
    assert a["step"] == b["step"] == 12 and _weights_equal(a, b)


def test_a_cut_short_checkpoint_is_skipped_for_the_one_before(tiny_cache, tmp_path):
    args = tiny_train_args(tiny_cache, tmp_path, name="c", max_steps=8, ckpt_every=4)
    assert run_cli("train.pretrain", "--config", SMOKE, "--no-progress", *args).returncode == 0
    ckdir = tmp_path / "c" / "checkpoints"
    newest = ckdir / "step_0000008.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])
    (ckdir / "latest.pt").write_bytes(b"")
    longer = tiny_train_args(tiny_cache, tmp_path, name="c", max_steps=10, ckpt_every=4)
    r = run_cli("train.pretrain", "--config", SMOKE, "--no-progress", *longer)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"checkpoint {newest} is unreadable" in r.stdout
    assert "resumed from" in r.stdout and "step_0000004.pt" in r.stdout
    assert checkpoint.load(str(ckdir / "latest.pt"))["step"] == 10
