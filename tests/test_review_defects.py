"""Issue 75, item 4: what keys a kept result (the features' code), what a resumed
fine-tuning run reports as its start, and the learning check's result files and job names."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import keys_after_edits
from octfm import config
from train import checkpoint, runtime

QUICK = ["workers=0", "batch_size=4", "bootstrap=20", "device=cpu", "precision=fp32", "patience=0", "frozen_epochs=0"]


@pytest.fixture(scope="module")
def pretrained(signal_run):
    """The session's 2-step run on the planted-signal cache: its checkpoints folder (read only)."""
    return signal_run / "checkpoints"


# ---------------------------------------------------------------- 3: the start a resumed run trained from
def test_a_resumed_finetune_reports_the_start_it_trained_from(pretrained, tmp_path):
    """CKPT=<run>/checkpoints/latest.pt, and the pretraining saves again before the fine-tuning run
    resumes: metrics.json's `from` is the checkpoint the run trained from (step 2), not the one
    latest.pt points at now (step 4)."""
    from evals import finetune
    from evals.config import FinetuneConfig

    pretrained = Path(shutil.copytree(pretrained, tmp_path / "checkpoints"))  # this test saves into it
    cfg = config.load(FinetuneConfig, "configs/finetune.yaml",
                      [f"ckpt={pretrained / 'latest.pt'}", f"out={tmp_path / 'ft'}", "epochs=2", *QUICK])
    first = finetune.Finetuner(cfg, runtime.setup("cpu", "fp32"))
    assert first.ident["step"] == 2
    first.step, first.epoch = first.per_epoch, 1  # as if epoch 1 had trained, then the run stopped
    first.history = [{"epoch": 1, "step": first.step, "balanced_accuracy": 0.5, "auroc": 0.5, "loss": 1.0}]
    first.save()
    first.writer.wait()
    st = checkpoint.load(str(pretrained / "step_0000002.pt"))
    checkpoint.save({**st, "step": 4}, str(pretrained), 4)  # the pretraining moves on
    resumed = finetune.Finetuner(cfg, runtime.setup("cpu", "fp32"))
    assert resumed.resumed
    res = resumed.run(progress=False)
    reported = json.loads((tmp_path / "ft" / "diabetic" / "metrics.json").read_text())["from"]
    assert reported == res["from"] == first.ident, reported
    assert checkpoint.load(str(tmp_path / "ft" / "checkpoints" / "best.pt"))["finetune"]["from"] == first.ident


# ---------------------------------------------------------------- 4: kept features keyed on their code
def test_kept_features_embeddings_and_leaderboard_rows_are_keyed_on_their_code(tmp_path, monkeypatch):
    """An edit to the model's code (the bf16 residual stream changed the pooled features) makes the
    features, the embeddings and the leaderboard's stored rows afresh: their keys change; an edit
    to a file none of them imports keeps them."""
    from evals import embed, features, leaderboard
    from evals.config import ProbeConfig
    from train.config import TrainConfig

    ident, cfg = {"step": 2, "name": "step_0000002.pt"}, TrainConfig()
    rows = [{"relpath": "a.dcm", "cache_key": "k"}]

    def keys() -> tuple[str, str, str]:
        return (features.feature_key(ident, rows, cfg, (1, 2, 2)), embed.embed_key(ident, cfg, "c"),
                leaderboard.settings_key(ProbeConfig()))

    packages = {f.split("/")[0] for f in config.import_closure("evals/probe.py", "train/plan.py")}
    before, plan_edited, after = keys_after_edits(tmp_path, monkeypatch, packages, keys,
                                                  ["train/plan.py", "train/model.py"])
    assert plan_edited == before
    assert [a != b for a, b in zip(after, before)] == [True, True, True], (before, after)


# ---------------------------------------------------------------- 5: no earlier final result beside an interim one
def test_a_learning_check_sets_an_earlier_result_aside_when_it_starts(tmp_path, monkeypatch):
    """A check cut short (a lent GPU's minutes) leaves its result_interim.* only; an earlier run's
    result.* must not sit beside them, where `make learning-check-device` copies result* into OUT
    as if this run had finished: the run moves them into previous/ before its first stage."""
    from check import learning_check

    dest = tmp_path / "runs" / "lesions"
    dest.mkdir(parents=True)
    for name in ("result.json", "result.md", "result.png", "result_interim.json", "result_interim.md"):
        (dest / name).write_text("an earlier run's")

    def cut_short(*_a, **_k):
        raise KeyboardInterrupt  # the timeout, at the first stage
    monkeypatch.setattr(learning_check, "cohort", cut_short)
    with pytest.raises(KeyboardInterrupt):
        learning_check.check(learning_check.CheckConfig(work=str(tmp_path / "work"), out=str(tmp_path / "runs")))
    assert sorted(p.name for p in dest.glob("result*")) == []
    assert sorted(p.name for p in (dest / "previous").iterdir()) == [
        "result.json", "result.md", "result.png", "result_interim.json", "result_interim.md"]


# ---------------------------------------------------------------- 6: names made from label fractions
def test_fractions_that_round_to_one_percent_get_distinct_names():
    """0.1 and 0.104 both read "10%" when rounded: the learning check's jobs (named by pct), the rows'
    keys and the fine-tuning runs' folders (finetune_tag) would take one for the other. Whole
    percentages keep their names (and so their run folders)."""
    from check.keys import finetune_tag
    from check.learning_check import job_name
    from check.verdicts import pct

    assert pct(0.1) != pct(0.104) and pct(0.104) == "10.4%"
    assert job_name("random", 0.1) != job_name("random", 0.104)
    assert job_name("pretrained", 0.1, 7) == "fine-tuning (pretrained init, training seed 7), 10% of labels"
    assert finetune_tag("random", 0.1, None, 0) != finetune_tag("random", 0.104, None, 0)
    assert [pct(f) for f in (0.1, 0.25, 1.0, 1)] == ["10%", "25%", "100%", "100%"]
    assert finetune_tag("random", 0.1, 3, 0).startswith("random_10pct_s0_t3_")
