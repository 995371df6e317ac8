"""Checkpoints (issue 27): `latest` is a pointer to the newest step file, never a second full
copy."""
from __future__ import annotations

import torch

from train import checkpoint


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
    assert checkpoint.resolve(latest) == str(tmp_path / "step_0000004.pt")
    assert checkpoint.load(latest)["step"] == 4 and checkpoint.is_whole(latest)
    assert checkpoint.identity(latest) == checkpoint.identity(str(tmp_path / "step_0000004.pt"))
    assert checkpoint.candidates(str(tmp_path)) == [checkpoint.step_uri(str(tmp_path), s) for s in (4, 2)]
    uri, st = checkpoint.load_newest_good(str(tmp_path))
    assert uri.endswith("step_0000004.pt") and st["step"] == 4


def test_an_old_run_folder_with_a_real_latest_pt_keeps_loading_then_points(tmp_path):
    checkpoint.write(state(2), str(tmp_path / "step_0000002.pt"))  # as saves before the pointer left it
    checkpoint.write(state(2), str(tmp_path / "latest.pt"))
    assert checkpoint.load(str(tmp_path / "latest.pt"))["step"] == 2
    checkpoint.save(state(4), str(tmp_path), 4)  # the run resumed under the pointer
    assert files(tmp_path) == ["latest.txt", "step_0000002.pt", "step_0000004.pt"]
    assert checkpoint.load(str(tmp_path / "latest.pt"))["step"] == 4


def test_pruning_never_deletes_the_step_file_latest_points_to(tmp_path):
    """A run resumed from an older checkpoint (CKPT=...) saves below the highest step on disk."""
    checkpoint.save(state(8), str(tmp_path), 8)
    checkpoint.save(state(6), str(tmp_path), 6, keep_last=1)
    assert (tmp_path / "step_0000006.pt").exists(), files(tmp_path)
    assert checkpoint.load(str(tmp_path / "latest.pt"))["step"] == 6

