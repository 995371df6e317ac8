"""Checkpoints: `latest` is a pointer to the newest step file, never a second full
copy, and the trainer's saves are written in the background from a snapshot training cannot
change, one at a time, with any write error surfacing at the next save or the run's end."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from conftest import same_optimizer, same_weights, tiny_train_args

from octfm import cli, config, fsio
from train import checkpoint, pretrain, runtime
from train.config import TrainConfig

SMOKE = "configs/pretrain_smoke.yaml"


def state(step: int) -> dict:
    return {"step": step, "w": torch.full((64, 1024), float(step))}  # 256 KiB of weights


def files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_save_writes_one_step_file_and_a_pointer_not_a_second_copy(tmp_path):
    path = checkpoint.save(state(3), str(tmp_path), 3)
    one = (tmp_path / "step_0000003.pt").stat().st_size
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert on_disk < 1.5 * one, files(tmp_path)
    assert files(tmp_path) == ["latest.txt", "step_0000003.pt"] and path == str(tmp_path / "step_0000003.pt")


def test_latest_pt_names_the_newest_step_file_for_every_reader(tmp_path):
    checkpoint.save(state(2), str(tmp_path), 2)
    checkpoint.save(state(4), str(tmp_path), 4)
    latest = str(tmp_path / "latest.pt")
    assert checkpoint.resolve_latest(latest) == str(tmp_path / "step_0000004.pt")
    assert checkpoint.load(latest)["step"] == 4 and checkpoint.is_whole(latest)
    assert checkpoint.identity(latest) == checkpoint.identity(str(tmp_path / "step_0000004.pt"))
    assert checkpoint.candidates(str(tmp_path)) == [checkpoint.step_uri(str(tmp_path), s) for s in (4, 2)]
    uri, st = checkpoint.load_newest_good(str(tmp_path))
    assert uri.endswith("step_0000004.pt") and st["step"] == 4


def test_every_file_carries_its_format_and_one_without_is_refused(tmp_path):
    """Not skipped as damage by the newest-good scan either: a run would start afresh beside it."""
    checkpoint.write(state(2), str(tmp_path / "best.pt"))
    assert checkpoint.load(str(tmp_path / "best.pt"))["format"] == checkpoint.FORMAT
    torch.save(state(4), str(tmp_path / "step_0000004.pt"))  # as the code before the v1 cut saved
    for read in (lambda: checkpoint.load(str(tmp_path / "step_0000004.pt")),
                 lambda: checkpoint.load_newest_good(str(tmp_path))):
        with pytest.raises(cli.UsageError, match=r"step_0000004.pt: a checkpoint \(no format 2\) from before "
                                                 r"octfm's v1 cut; .*\(git checkout results-2026-12\)"):
            read()


def test_pruning_never_deletes_the_step_file_latest_points_to(tmp_path):
    """A run resumed from an older checkpoint (CKPT=...) saves below the highest step on disk."""
    checkpoint.save(state(8), str(tmp_path), 8)
    checkpoint.save(state(6), str(tmp_path), 6, keep_last=1)
    assert (tmp_path / "step_0000006.pt").exists(), files(tmp_path)
    assert checkpoint.load(str(tmp_path / "latest.pt"))["step"] == 6


def tiny(cache, tmp_path, **extra) -> pretrain.Trainer:
    cfg = config.load(TrainConfig, SMOKE, tiny_train_args(cache, tmp_path / "runs", **{"max_steps": 2, **extra}))
    tr = pretrain.Trainer(cfg, runtime.setup("cpu", "fp32"))
    tr.run_dir.mkdir(parents=True)
    return tr


@pytest.fixture
def trainer(tiny_cache, tmp_path):
    return tiny(tiny_cache, tmp_path, ckpt_every=2)


def held_saves(monkeypatch, seconds: float = 5.0) -> threading.Event:
    """checkpoint.save held until the returned event is set (at most `seconds`): a slow disk."""
    release, real = threading.Event(), checkpoint.save

    def slow(*args, **kw):
        release.wait(timeout=seconds)
        return real(*args, **kw)

    monkeypatch.setattr(checkpoint, "save", slow)
    return release


def test_a_save_returns_before_the_write_with_a_snapshot_training_cannot_change(trainer, monkeypatch):
    tr = trainer
    _, dl = tr.train_loader(0)
    tr.update([next(iter(dl))], tr.model)  # AdamW moments exist
    tr.step = 1
    expected = copy.deepcopy(tr.state())
    release = held_saves(monkeypatch)
    path = tr.save()
    assert not fsio.exists(path), "save waited for the write"
    with torch.no_grad():  # training goes on while the file is written
        for p in [*tr.model.parameters(), *tr.target.parameters()]:
            p.add_(1.0)
        for st in tr.opt.state.values():
            st["exp_avg"].add_(1.0)
        tr.guard.loss_mean.fill_(123.0)
    release.set()
    assert tr.writer.wait() == path
    saved = checkpoint.load(path)
    assert saved["step"] == 1 and same_weights(saved, expected) and same_optimizer(saved, expected)
    assert torch.equal(saved["loss_mean"], expected["loss_mean"])


def test_a_failed_background_write_surfaces_at_the_next_save_naming_the_file(trainer, tmp_path):
    tr = trainer
    (tmp_path / "blocker").write_text("")  # a file where the checkpoint folder should be
    tr.ckpt_dir = str(tmp_path / "blocker" / "checkpoints")
    tr.step = 1
    first = tr.save()
    tr.step = 2
    with pytest.raises(RuntimeError, match=f"checkpoint {first}"):
        tr.save()


def test_the_run_waits_for_its_last_write_and_raises_its_error(trainer, tmp_path):
    tr = trainer
    (tmp_path / "blocker").write_text("")
    tr.ckpt_dir = str(tmp_path / "blocker" / "checkpoints")
    with pytest.raises(RuntimeError, match="step_0000002.pt"):
        tr.run(progress=False)


def test_a_run_stopped_by_an_error_still_finishes_its_pending_write(tiny_cache, tmp_path, monkeypatch):
    """Guards the background path (the synchronous save passed it by construction)."""
    tr = tiny(tiny_cache, tmp_path, ckpt_every=1)
    held_saves(monkeypatch, seconds=1.0)  # the write of step 1 is still going when step 2 fails

    real = tr.update

    def stop(*args):
        if tr.step == 1:
            raise cli.JobAborted("stopped in step 2, the save of step 1 in flight")
        return real(*args)

    monkeypatch.setattr(tr, "update", stop)
    with pytest.raises(cli.JobAborted):
        tr.run(progress=False)
    assert checkpoint.list_steps(tr.ckpt_dir) == [1], "the pending write was waited for"


# ------------------------------------------------------------------ one meaning of "newest"
def test_after_a_resume_from_an_older_step_the_newest_is_the_last_written(tmp_path):
    """Save 6 and 8; resume from 6 (CKPT=) and save 7: automatic resume, make probe, the lockout
    message and the learning check all take 7 (the pointer), never the abandoned 8; pruning goes
    by write order and keeps the pointed file."""
    d = str(tmp_path)
    checkpoint.save(state(6), d, 6)
    checkpoint.save(state(8), d, 8)
    checkpoint.save(state(7), d, 7, keep_last=2)
    assert files(tmp_path) == ["latest.txt", "step_0000007.pt", "step_0000008.pt"]  # 7 and 8 written last
    assert checkpoint.candidates(d)[0].endswith("step_0000007.pt")
    assert checkpoint.newest_whole(d).endswith("step_0000007.pt")
    uri, st = checkpoint.load_newest_good(d)
    assert uri.endswith("step_0000007.pt") and st["step"] == 7
    checkpoint.save(state(8), d, 8, keep_last=1)  # the branch goes on: its own 8 replaces the abandoned one
    assert files(tmp_path) == ["latest.txt", "step_0000008.pt"]
    assert float(checkpoint.load(str(tmp_path / "latest.pt"))["w"][0, 0]) == 8


def test_pruning_to_one_after_a_branch_keeps_only_the_pointed_file(tmp_path):
    d = str(tmp_path)
    for s in (6, 8):
        checkpoint.save(state(s), d, s)
    checkpoint.save(state(7), d, 7, keep_last=1)
    assert files(tmp_path) == ["latest.txt", "step_0000007.pt"]
    assert checkpoint.newest_whole(d).endswith("step_0000007.pt")


def test_a_reader_following_the_pointer_survives_a_prune_in_between(tmp_path, monkeypatch):
    """The pointer names step 7; before the reader opens it a save of 9 with keep_last=1 prunes 7:
    the reader follows the pointer again and reads 9 instead of failing."""
    d = str(tmp_path)
    checkpoint.save(state(7), d, 7)
    real, raced = fsio.read_bytes, []

    def racing(uri):
        if uri.endswith("step_0000007.pt") and not raced:
            raced.append(uri)
            checkpoint.save(state(9), d, 9, keep_last=1)  # another process saves and prunes right now
        return real(uri)

    monkeypatch.setattr(fsio, "read_bytes", racing)
    assert checkpoint.load(str(tmp_path / "latest.pt"))["step"] == 9 and raced
    raced.clear()
    checkpoint.save(state(7), d, 7, keep_last=None)  # a branch again; the newest-good scan races the same way
    uri, st = checkpoint.load_newest_good(d)
    assert st["step"] == 9 and uri.endswith("step_0000009.pt") and raced


# ------------------------------------------------------------------ files that vanish are said
VANISHED = "disappeared while they were being read"


def _vanishing(monkeypatch, then=lambda: None):
    """Every read of a step file finds it gone (another process pruning faster than we read), and
    `then()` runs at each."""
    def gone(*_):
        then()
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(fsio, "read_bytes", gone)
    monkeypatch.setattr(checkpoint, "is_whole", gone)


def test_checkpoints_that_keep_vanishing_are_said_to_vanish(tmp_path, monkeypatch):
    """Not "no checkpoint reads back whole, move them aside" (they were whole), nor "no checkpoint"."""
    from evals import probe
    from evals.config import ProbeConfig

    d = tmp_path / "run" / "checkpoints"
    checkpoint.save(state(4), str(d), 4)
    _vanishing(monkeypatch)
    with pytest.raises(cli.JobAborted, match=VANISHED):
        checkpoint.load_newest_good(str(d))
    with pytest.raises(cli.JobAborted, match=VANISHED):
        checkpoint.newest_whole(str(d))
    with pytest.raises(cli.JobAborted, match=VANISHED):                 # `make probe RUN=...`
        probe.resolve_checkpoint(ProbeConfig(run=str(tmp_path / "run")))


def test_checkpoints_that_vanish_for_good_mid_read_are_not_a_fresh_start(tmp_path, monkeypatch):
    """Seen, then gone while read: said, rather than a resume starting the run from step 0."""
    for reader in (checkpoint.load_newest_good, checkpoint.newest_whole):
        d = tmp_path / reader.__name__
        checkpoint.save(state(4), str(d), 4)
        with monkeypatch.context() as m:
            _vanishing(m, then=lambda: [p.unlink() for p in d.iterdir()])  # noqa: B023
            with pytest.raises(cli.JobAborted, match=VANISHED):
                reader(str(d))
