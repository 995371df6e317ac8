"""Evaluation where the checkpoint is: a gs:// run as a TPU run leaves it (its checkpoints, and the
config.yaml and metrics.jsonl the trainer copies beside them) is a run every evaluation command
takes, on the GCS emulator; a run stands for its newest checkpoint; the leaderboard probes a bounded,
stated set; evaluation runs on the accelerator when there is one. (The whole path, trained and
probed: the rehearsal, tests/test_rehearsal.py.)"""
from pathlib import Path

import pytest
import torch
import yaml

from conftest import gcs_bucket
from evals import embed, leaderboard, probe
from evals.config import ProbeConfig
from octfm import config
from train import checkpoint, run_folder, runtime
from train.metrics import read_splits


def upload_run(run: Path, bucket: str, tmp_path: Path) -> str:
    """tiny_run's checkpoints, config and metrics in one gs:// folder, as a TPU run's ckpt_dir holds them."""
    fs = gcs_bucket(bucket)
    uri = f"gs://{bucket}/runs/tiny"
    for f in sorted((run / "checkpoints").iterdir()):
        fs.put_file(str(f), f"{bucket}/runs/tiny/{f.name}")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg.update(ckpt_dir=uri, runs_dir=str(tmp_path / "runs"))   # what the trainer published: its own folder
    fs.pipe_file(f"{bucket}/runs/tiny/config.yaml", yaml.safe_dump(cfg).encode())
    fs.put_file(str(run / "metrics.jsonl"), f"{bucket}/runs/tiny/metrics.jsonl")
    fs.invalidate_cache()
    return uri


def test_a_gs_run_is_a_run_every_evaluation_takes(tiny_run, gcs_emulator, tmp_path):
    uri = upload_run(tiny_run, "evals", tmp_path)
    assert run_folder.checkpoint_dir(uri) == uri
    assert run_folder.local_folder(uri) == tmp_path / "runs" / "tiny"           # where its reports go
    newest = f"{uri}/step_0000004.pt"
    assert checkpoint.resolve_latest(uri) == newest == probe.resolve_checkpoint(ProbeConfig(run=uri))
    assert checkpoint.identity(uri)["name"] == "step_0000004.pt"
    assert read_splits(uri)["train"][4]["loss"] == read_splits(tiny_run)["train"][4]["loss"]
    board = leaderboard.Board(config.load(ProbeConfig, "configs/probe.yaml", ["max_checkpoints=1"]))
    done, todo = board.plan(uri)
    assert not done and [t[0] for t in todo] == [4] and board.left_out[uri] == 1
    # a runs_dir on gs:// keeps them in checkpoints/ under the run, with no copied config beside them
    fs = gcs_bucket("evals")
    for name in ("step_0000002.pt", "latest.txt"):
        fs.copy(f"evals/runs/tiny/{name}", f"evals/nested/tiny/checkpoints/{name}")
    fs.invalidate_cache()
    assert run_folder.checkpoint_dir("gs://evals/nested/tiny") == "gs://evals/nested/tiny/checkpoints"
    assert run_folder.local_folder("gs://evals/nested/tiny") == Path("runs") / "tiny"


def test_a_run_stands_for_its_newest_checkpoint(tiny_run):
    assert checkpoint.resolve_latest(str(tiny_run)) == str(tiny_run / "checkpoints" / "step_0000004.pt")
    assert checkpoint.resolve_latest(str(tiny_run) + "/") == checkpoint.resolve_latest(str(tiny_run))
    assert checkpoint.load(str(tiny_run))["step"] == 4


def test_the_bounded_set_is_evenly_spaced_with_the_newest():
    steps = list(range(1000, 30001, 1000))
    assert leaderboard.bounded_steps(steps, 8) == [1000, 5000, 9000, 13000, 18000, 22000, 26000, 30000]
    assert leaderboard.bounded_steps(steps, 1) == [30000] and leaderboard.bounded_steps(steps, 0) == steps
    assert leaderboard.bounded_steps(steps[:3], 8) == steps[:3]


def test_the_leaderboard_states_its_set_and_time_before_it_starts(tiny_run, capsys):
    cfg = config.load(ProbeConfig, "configs/probe.yaml", [*leaderboard.DEFAULTS, "extract_batch=2"])
    line = leaderboard.estimate_line(cfg, [(str(tiny_run), 4, str(tiny_run / "checkpoints" / "step_0000004.pt"), {})])
    assert line.startswith("leaderboard: ESTIMATE 1 checkpoint(s) x a feature pass over ")
    assert "labelled volumes on cpu" in line and "(one batch of 2 timed)" in line


def test_evaluation_runs_on_the_accelerator_when_there_is_one(monkeypatch):
    assert ProbeConfig().device == "auto" and config.load(ProbeConfig, "configs/probe.yaml").device == "auto"
    assert runtime.device_for("auto") == "cpu" and runtime.device_for("cpu") == "cpu"   # this machine has none
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime.device_for("auto") == "cuda"
    assert probe.heads_device("auto") == "cuda"
    monkeypatch.setattr(runtime, "device_for", lambda kind: "xla:0")
    assert probe.heads_device("auto") == "cpu"          # a TPU extracts features; the small head graphs train on the CPU
    import inspect

    assert inspect.signature(embed.embed).parameters["device"].default == "auto"


@pytest.mark.parametrize("target", ["probe", "embed", "export"])
def test_the_evaluation_commands_take_a_run(target):
    """make probe RUN=..., make embed/export CKPT=<a run>: as README's Evaluate section writes them."""
    import subprocess

    from conftest import REPO

    extra = {"probe": ["RUN=gs://b/runs/x"], "embed": ["CKPT=gs://b/runs/x"], "export": ["CKPT=gs://b/runs/x", "OUT=m"]}
    out = subprocess.run(["make", "-n", "-s", target, *extra[target]], cwd=REPO, capture_output=True, text=True,
                         timeout=60).stdout
    assert "gs://b/runs/x" in out.splitlines()[-1] and "--device" not in out
