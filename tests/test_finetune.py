"""`make finetune`: end to end from the session's tiny run (the planted-signal run where a label fraction
must leave train participants out), frozen epochs, layer-wise decay, a killed run resumed, a model folder
and a checkpoint alike."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, run_cli, run_here, same_optimizer, same_state
from evals import finetune, finetune_schedule
from evals.config import FinetuneConfig
from octfm import config
from octfm.config import ConfigError
from cache import store
from evals.probe_heads import load_classifier
from train import checkpoint, runtime

QUICK = ["workers=0", "global_batch=4", "bootstrap=20", "device=cpu", "precision=fp32", "patience=0", "frozen_epochs=0"]


@pytest.fixture(scope="session")
def pretrained(tiny_run):
    """The session's tiny run's last checkpoint (tiny_cache's 24 volumes, 8 of them train): read only, every
    run here writes under its own `out`."""
    return tiny_run / "checkpoints" / "step_0000004.pt"


@pytest.fixture(scope="session")
def signal_pretrained(signal_run):
    """The shared 2-step run on the planted-signal cache (40 train participants): for the tests whose
    label fraction must be a strict subset of the train participants (tiny_cache has four)."""
    return signal_run / "checkpoints" / "step_0000002.pt"


def _cfg(ckpt, out, **kw) -> FinetuneConfig:
    items = [f"ckpt={ckpt}", f"out={out}", *QUICK, *(f"{k}={v}" for k, v in kw.items())]
    return config.load(FinetuneConfig, "configs/finetune.yaml", items)


def _finetuner(cfg: FinetuneConfig) -> finetune.Finetuner:
    return finetune.Finetuner(cfg, runtime.setup("cpu", "fp32"))


def test_a_tiny_finetune_runs_end_to_end(pretrained, tmp_path):
    out = tmp_path / "ft"
    r = run_cli("evals.finetune", "--no-progress", "--ckpt", str(pretrained), f"out={out}", "epochs=2", *QUICK)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "diabetic (test, best val epoch" in r.stdout and "all" in r.stdout
    m = json.loads((out / "diabetic" / "metrics.json").read_text())
    ft = m["probes"][0]
    assert ft["encoder"] == "finetuned_pretrained" and ft["head"] == "linear"  # the shipped recipe, without --config
    assert 0 <= ft["test"]["balanced_accuracy"] <= 1 and len(ft["test"]["balanced_accuracy_ci95"]) == 2
    assert [h["epoch"] for h in m["history"]] == [1, 2]
    assert set(m["per_scanner"][ft["head"]])  # every test device reported
    for f in ("report.md", "confusion.png", "roc.png", "curves.png"):
        assert (out / "diabetic" / f).stat().st_size > 0, f
    vals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [v["epoch"] for v in vals if v["split"] == "val"] == [1, 2]
    # the best epoch reads as a checkpoint of its encoder (make export / embed / probe) and carries its head
    best = checkpoint.load(str(out / "checkpoints" / "best.pt"))
    assert best["step"] == ft["best_epoch"] and best["finetune"]["task"] == "diabetic" and "head" in best
    # a row in the leaderboard, from the report (nothing probed); in this process: the command's own
    # start is checked above, and another interpreter would cost seconds of imports
    from evals import leaderboard

    with contextlib.redirect_stdout(io.StringIO()):
        assert leaderboard.main(["--run", str(out)]) == 0
    assert "finetuned_pretrained linear" in (out / "leaderboard.md").read_text()
    # run again: nothing left to train, the same report from the best epoch
    again = io.StringIO()
    with contextlib.redirect_stdout(again):
        assert finetune.main(["--no-progress", "--ckpt", str(pretrained), f"out={out}", "epochs=2", *QUICK]) == 0
    assert "resumed" in again.getvalue()
    assert json.loads((out / "diabetic" / "metrics.json").read_text())["probes"][0]["test"] == ft["test"]


def test_frozen_epochs_leave_the_encoder_bit_identical(pretrained, tmp_path):
    ft = _finetuner(_cfg(pretrained, tmp_path / "frozen", epochs=1, frozen_epochs=1))
    enc0 = {k: v.clone() for k, v in ft.model.encoder.state_dict().items()}
    head0 = {k: v.clone() for k, v in ft.model.head.state_dict().items()}
    ft.run(progress=False)
    assert same_state(enc0, ft.model.encoder.state_dict())
    assert not same_state(head0, ft.model.head.state_dict())
    # and unfrozen, the encoder moves
    ft2 = _finetuner(_cfg(pretrained, tmp_path / "thawed", epochs=1, frozen_epochs=0))
    ft2.run(progress=False)
    assert not same_state(enc0, ft2.model.encoder.state_dict())


def test_layer_decay_gives_each_block_its_learning_rate(pretrained, tmp_path):
    cfg = _cfg(pretrained, tmp_path / "lrs", lr=1e-3, layer_decay=0.5, head_lr=7e-3, drop_path=0.2, head="linear")
    ft = _finetuner(cfg)
    depth = len(ft.model.encoder.blocks)
    assert depth == 2
    # as documented (evals/finetune.py, configs/finetune.yaml): the last block and the final norm at lr,
    # each block below x layer_decay, the stem and patchify lowest
    expect = {"encoder.patch.weight": 1e-3 * 0.5 ** 2, "encoder.blocks.0.attn.qkv.weight": 1e-3 * 0.5,
              "encoder.blocks.0.norm1.bias": 1e-3 * 0.5, "encoder.blocks.1.mlp.0.weight": 1e-3,
              "encoder.norm.weight": 1e-3, "head.heads.w": 7e-3, "head.heads.b": 7e-3}
    names = [n for g in ft.groups for n in g["names"]]
    assert sorted(names) == sorted(n for n, _ in ft.model.named_parameters())  # every parameter in exactly one group
    peak = {n: g["peak_lr"] for g in ft.groups for n in g["names"]}
    for name, lr in expect.items():
        assert peak[name] == pytest.approx(lr), name
    decay = {n: g["weight_decay"] for g in ft.groups for n in g["names"]}
    assert decay["encoder.blocks.0.attn.qkv.weight"] == 0.05 and decay["encoder.blocks.0.norm1.bias"] == 0.0
    assert decay["head.heads.w"] == 0.05 and decay["head.heads.b"] == 0.0  # the head's bias: no decay ("weights only")
    # AdamW's groups are these groups, each with its own device lr tensor (the loop writes peak x factor into it)
    for og, g, lr in zip(ft.opt.param_groups, ft.groups, ft.lrs, strict=True):
        assert og["lr"] is lr and len(og["params"]) == len(g["params"])
        assert all(a is b for a, b in zip(og["params"], g["params"])) and og["weight_decay"] == g["weight_decay"]
    # linear warmup, then cosine from 1 to 0
    assert [finetune_schedule.lr_factor(s, 110, 10) for s in (0, 9, 60, 110)] == pytest.approx([0.1, 1.0, 0.5, 0.0])
    # the loop computes it on the device from a step tensor: the same values
    assert [float(finetune_schedule.lr_factor(torch.tensor(float(s)), 110, 10)) for s in (0, 9, 60, 110)] == \
        pytest.approx([0.1, 1.0, 0.5, 0.0], abs=1e-6)
    assert [b.drop_path for b in ft.model.encoder.blocks] == [0.0, pytest.approx(0.2)]


def _all_embeddings(ft: finetune.Finetuner) -> tuple[np.ndarray, np.ndarray]:
    """Every row's pooled vector and pooled token grid (centre crops), through the exported
    encoder's path (encoder.wrap), as the probes' features are computed."""
    from train import encoder

    wrapped = encoder.wrap(ft.model.encoder, ft.tcfg.data.stride, ft.tcfg.data.input_shape)
    vols = torch.stack([torch.from_numpy(store.read_volume(ft.tcfg.data.cache, r["volume"])) for r in ft.rows])
    out = wrapped(vols)
    return out.pooled.numpy(), ft.model.encoder.pool_grid(out.tokens, ft.cfg.token_pool).numpy()


def _train_embeddings(ft: finetune.Finetuner) -> tuple[np.ndarray, np.ndarray]:
    """The train rows' pooled vectors and pooled token grids (_all_embeddings)."""
    pooled, tokens = _all_embeddings(ft)
    return pooled[ft.train], tokens[ft.train]


def test_the_head_reads_channels_standardised_by_the_train_rows_at_the_start(signal_pretrained, tmp_path):
    """The probes' heads read standardised channels and fine-tuning's head does too (docs/recipe.md,
    Fine-tuning), by the statistics of the encoder it starts from over the label fraction's train rows; a token head scales its tokens as well (the attentive head here).
    `standardize=false`: the head as before. The statistics stay fixed while the encoder trains."""
    ft = _finetuner(_cfg(signal_pretrained, tmp_path / "att", head="attentive", label_fraction=0.5, epochs=1))
    pooled, tokens = _train_embeddings(ft)
    assert ft.train.sum() < (ft.split == "train").sum()  # a label fraction: the statistics are its rows'
    scaled = ft.model.head.scale_p(torch.from_numpy(pooled)).numpy()
    moving = pooled.std(0) > 1e-4
    assert np.allclose(scaled.mean(0), 0, atol=1e-3) and np.allclose(scaled.std(0)[moving], 1, atol=1e-2)
    t = ft.model.head.scale_t(torch.from_numpy(tokens)).numpy().reshape(-1, tokens.shape[-1])
    assert np.allclose(t.mean(0), 0, atol=1e-3)
    before = {k: v.clone() for k, v in ft.model.head.state_dict().items() if k.startswith("scale")}
    ft.run(progress=False)
    assert same_state(before, {k: v for k, v in ft.model.head.state_dict().items() if k.startswith("scale")})
    plain = _finetuner(_cfg(signal_pretrained, tmp_path / "plain", head="attentive", standardize="false"))
    assert not hasattr(plain.model.head, "scale_p")




def test_a_resumed_run_takes_its_head_from_the_checkpoint(pretrained, tmp_path, monkeypatch):
    """A resume rebuilds the head (its kind and scalers) from the checkpoint instead of extracting the
    start features again: the resumed head is the one the cut run held when it saved (not merely the
    file's, which the resume read), and epoch 1 had moved it from its start; the saved shapes load
    into the head make_heads builds (probe_heads.shaped_like, as make export's folders do)."""
    from evals import probe_heads

    cfg = _cfg(pretrained, tmp_path / "cut", label_fraction=0.5, epochs=2, head="attentive")
    ft = _finetuner(cfg)
    held = lambda: {k: v.detach().clone() for k, v in ft.model.head.state_dict().items()}  # noqa: E731
    start, at_save = held(), []
    real, real_save = ft.validate, ft.save

    def validate():
        if ft.epoch > 1:
            raise KeyboardInterrupt  # killed at the end of epoch 2: epoch 1 was saved
        return real()

    def save():
        at_save.append(held())
        real_save()
    ft.validate, ft.save = validate, save
    with pytest.raises(KeyboardInterrupt):
        ft.run(progress=False)
    _, st = checkpoint.load_newest_good(ft.ckpt_dir)

    def refused(*_a, **_k):
        raise AssertionError("the start features were extracted again on a resume")
    monkeypatch.setattr(finetune.Finetuner, "start_features", refused)
    again = _finetuner(cfg)
    assert again.resumed and again.epoch == 1 and again.kind == ft.kind
    assert len(at_save) == 1 and not same_state(at_save[0], start)     # epoch 1 trained the head
    assert same_state(again.model.head.state_dict(), at_save[0])
    assert again.run(progress=False)["epochs_run"] == 2
    made = probe_heads.make_heads(ft.kind, 1, ft.model.encoder.norm.normalized_shape[0], 2)
    probe_heads.shaped_like(ft.kind, made, st["head"]).load_state_dict(st["head"])  # strict: every key, every shape



@pytest.mark.slow  # about 30 s on 2 cores (a run killed mid-epoch, resumed, and the uninterrupted one): the heavy lane
def test_a_killed_run_resumes_to_the_same_weights(pretrained, tmp_path):
    args = ["--no-progress", "--ckpt", str(pretrained), "epochs=2", *QUICK]
    whole = run_cli("evals.finetune", *args, f"out={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-2000:]
    cut = tmp_path / "cut"
    killed = subprocess.run([sys.executable, "tests/fault_inject.py", "--kill-at-fsync", "step_0000002.pt",
                             "-m", "evals.finetune", *args, f"out={cut}"], cwd=REPO, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert checkpoint.list_steps(str(cut / "checkpoints")) == [1]
    resumed = run_cli("evals.finetune", *args, f"out={cut}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "at epoch 1" in resumed.stdout
    a = checkpoint.load(str(tmp_path / "whole" / "checkpoints" / "step_0000002.pt"))
    b = checkpoint.load(str(cut / "checkpoints" / "step_0000002.pt"))
    assert same_state(a["target"], b["target"]) and same_state(a["head"], b["head"])
    assert same_optimizer(a, b)
    # another setting under the same folder is refused, naming it
    other = run_cli("evals.finetune", *args, f"out={cut}", "lr=1e-4")
    assert other.returncode == 2 and "lr" in other.stderr and "out=" in other.stderr


def test_a_model_folder_and_a_checkpoint_finetune_alike(pretrained, tmp_path):
    folder = tmp_path / "model"
    r = run_here("evals.export", "--ckpt", str(pretrained), "--out", str(folder))
    assert r.returncode == 0, r.stderr[-2000:]
    runs = {name: _finetuner(_cfg(src, tmp_path / name, epochs=1)) for name, src in (("ckpt", pretrained),
                                                                                      ("folder", folder))}
    # the same model (encoder and head) and the same data settings: the same run from here on
    assert same_state(runs["ckpt"].model.state_dict(), runs["folder"].model.state_dict())
    assert runs["folder"].tcfg.data == runs["ckpt"].tcfg.data
    assert (runs["folder"].train == runs["ckpt"].train).all()


def test_random_init_is_the_same_architecture_from_scratch(pretrained, tmp_path):
    pre = _finetuner(_cfg(pretrained, tmp_path / "a"))
    rnd = _finetuner(_cfg(pretrained, tmp_path / "b", init="random"))
    assert [k for k in pre.model.state_dict()] == [k for k in rnd.model.state_dict()]
    assert not same_state(pre.model.encoder.state_dict(), rnd.model.encoder.state_dict())


def test_the_best_epoch_exports_with_its_head(pretrained, tmp_path):
    ft = _finetuner(_cfg(pretrained, tmp_path / "ft", epochs=1, head="attentive"))  # the head with more to export
    ft.run(progress=False)  # leaves the best epoch's weights in the model
    folder = tmp_path / "model"
    r = run_here("evals.export", "--ckpt", str(tmp_path / "ft" / "checkpoints" / "best.pt"), "--out", str(folder))
    assert r.returncode == 0, r.stderr[-2000:]
    conf = json.loads((folder / "config.json").read_text())
    assert conf["head"]["task"] == "diabetic" and conf["head"]["kind"] == "attentive"
    assert "Fine-tuned end to end for `diabetic`" in (folder / "README.md").read_text()
    clf = load_classifier(folder)
    test = ft.split == "test"
    rows = [r for r, m in zip(ft.rows, test) if m][:6]
    vols = torch.stack([torch.from_numpy(store.read_volume(ft.tcfg.data.cache, r["volume"])) for r in rows])
    expect = ft.predict(np.array([any(r is q for q in rows) for r in ft.rows]))
    assert np.allclose(clf(vols).numpy(), expect, atol=1e-5)
    assert clf.classes == ["not_diabetic", "diabetic"]


@pytest.mark.slow
def test_two_process_finetune_under_torchrun(pretrained, tmp_path):
    """DDP on two CPU processes (gloo): a frozen epoch (only the head is wrapped) then a thawed one."""
    from conftest import free_port

    out = tmp_path / "ddp"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "evals.finetune", "--no-progress", "--ckpt", str(pretrained), f"out={out}",
                        *QUICK, "epochs=2", "frozen_epochs=1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "on cpu x2" in r.stdout
    m = json.loads((out / "diabetic" / "metrics.json").read_text())
    assert [h["epoch"] for h in m["history"]] == [1, 2]


def test_the_encoder_warms_up_again_when_it_unfreezes(pretrained, tmp_path):
    """With frozen epochs, the encoder's groups enter AdamW at the unfreezing step with empty
    moments: their learning rate ramps up from there over warmup_epochs (lr x sign(g) on every
    weight at a factor near 1 washes pretrained features out); the head's follows the one schedule."""
    cfg = _cfg(pretrained, tmp_path / "warm", epochs=3, frozen_epochs=1, warmup_epochs=1, lr=1e-3, head_lr=1e-3)
    ft = _finetuner(cfg)
    seen = []
    real = ft.update

    def record(net, b):
        seen.append({g["names"][0].split(".")[0]: float(lr) for g, lr in zip(ft.groups, ft.lrs)})
        return real(net, b)

    ft.update = record
    ft.run(progress=False)
    per_epoch = len(seen) // 3
    first_thawed = seen[per_epoch]
    assert first_thawed["encoder"] == pytest.approx(1e-3 / per_epoch, rel=0.05), (per_epoch, first_thawed)
    assert first_thawed["head"] > 0.8e-3                       # the head is past its warmup
    ramp = [s["encoder"] / s["head"] for s in seen[per_epoch:2 * per_epoch + 2]]  # the same peak lr: the ramp alone
    assert ramp == pytest.approx([min(1.0, (i + 1) / per_epoch) for i in range(per_epoch + 2)])


def test_a_non_finite_loss_leaves_the_weights_and_the_optimizer_alone(pretrained, tmp_path):
    """A NaN loss (bf16 overflow, a bad batch) is skipped and counted, as in pretraining."""
    ft = _finetuner(_cfg(pretrained, tmp_path / "nan", epochs=1, frozen_epochs=0))
    _, dl = ft.loader(0)
    b = next(iter(dl))
    ft.set_phase(0)
    for g, lr in zip(ft.groups, ft.lrs):
        lr.fill_(g["peak_lr"])
    ft.update(ft.model, b)                                       # one real step: AdamW has state
    before = {k: v.clone() for k, v in ft.model.state_dict().items()}
    opt_before = {id(p): {k: v.clone() for k, v in st.items()} for p, st in ft.opt.state.items()}
    bad = {**b, "aug": torch.full_like(b["aug"], float("nan"))}
    loss = ft.update(ft.model, bad)
    assert not torch.isfinite(loss)
    assert same_state(before, ft.model.state_dict())
    for p, st in ft.opt.state.items():
        assert all(torch.equal(v, opt_before[id(p)][k]) for k, v in st.items())
    assert int(ft.guard.skipped) == 1
    assert torch.isfinite(ft.update(ft.model, b)) and int(ft.guard.skipped) == 1  # and training goes on


def test_a_step_budget_ends_the_run_whatever_the_label_fraction(pretrained, tmp_path):
    """max_steps (FinetuneConfig) stops a run at a number of optimizer steps, so all labels do not
    train ten times the steps of 10%; never before the frozen epochs and one more."""
    cfg = _cfg(pretrained, tmp_path / "budget", epochs=40, frozen_epochs=1, max_steps=5)
    assert finetune_schedule.budget_epochs(cfg, per_epoch=2) == 3 and finetune_schedule.budget_epochs(cfg, per_epoch=10) == 2
    assert finetune_schedule.budget_epochs(_cfg(pretrained, tmp_path / "b2", epochs=4), per_epoch=2) == 4
    ft = _finetuner(cfg)
    per_epoch = ft.loader(0)[0]
    res = ft.run(progress=False)
    assert res["epochs_run"] == finetune_schedule.budget_epochs(cfg, per_epoch) < 40


def test_validation_reads_the_val_volumes_once(pretrained, tmp_path, monkeypatch):
    from train import encoder

    reads, real = [], encoder.volume_batches

    def counting(cache, rows, *a, **kw):
        reads.append(sorted(r["relpath"] for r in rows))
        return real(cache, rows, *a, **kw)

    monkeypatch.setattr(encoder, "volume_batches", counting)
    ft = _finetuner(_cfg(pretrained, tmp_path / "val", epochs=3))
    ft.run(progress=False)
    val = sorted(r["relpath"] for r, s in zip(ft.rows, ft.split) if s == "val")
    assert reads.count(val) == 1, reads  # three epochs' validation, one read (finish reads val and test once)


def test_a_training_seed_keeps_the_labelled_participants(signal_pretrained, tmp_path):
    """train_seed varies the training (random init, head, order) on the participants `seed` picked:
    several training seeds per init read on one subset; unset, it is `seed`."""
    runs = {ts: _finetuner(_cfg(signal_pretrained, tmp_path / f"t{ts}", init="random", label_fraction=0.5, seed=3,
                                **({} if ts is None else {"train_seed": ts}))) for ts in (None, 3, 4)}
    other = _finetuner(_cfg(signal_pretrained, tmp_path / "s4", init="random", label_fraction=0.5, seed=4))
    assert np.array_equal(runs[None].train, runs[4].train) and not np.array_equal(runs[None].train, other.train)
    assert same_state(runs[None].model.state_dict(), runs[3].model.state_dict())
    assert not same_state(runs[3].model.state_dict(), runs[4].model.state_dict())
    # the same training seed, the same encoder; the head (its channel statistics and the probe it starts as) is
    # fitted on each run's own participants
    assert same_state(runs[4].model.encoder.state_dict(), other.model.encoder.state_dict())
    assert not same_state(runs[4].model.head.scale_p.state_dict(), other.model.head.scale_p.state_dict())


@pytest.mark.parametrize("epochs, frozen, last", [pytest.param(12, 6, 9, marks=pytest.mark.slow),  # 16 s: heavy lane
                                                  (10, 2, 7)])
def test_patience_counts_only_epochs_after_the_encoders_warmup_and_half_the_run(pretrained, tmp_path, epochs,
                                                                                frozen, last):
    """Early stopping spends patience only once the encoder has trained through its warmup (in
    the frozen epochs and the warmup after them it cannot improve; counting them stopped the layers
    cue's fine-tuning 6 epochs after the thaw with val at chance) and only in the run's second half
    (a slow starter, random init at 10% of labels, left chance after half its epochs; both in
    docs/history/learning-check.md, patience). Val peaks at epoch 1 here and never
    again; patience 2. 12 epochs, 6 frozen: the warmup ends at epoch 7, later than half (6), so 8
    and 9 spend it. 10 epochs, 2 frozen: half (5) is later than the warmup's end (3): 6 and 7."""
    cfg = _cfg(pretrained, tmp_path / "patience", epochs=epochs, frozen_epochs=frozen, warmup_epochs=1, patience=2)
    ft = _finetuner(cfg)
    scores = iter([0.6] + [0.5] * 20)
    ft.validate = lambda: {"epoch": ft.epoch, "step": ft.step, "balanced_accuracy": next(scores), "auroc": 0.5}
    res = ft.run(progress=False)
    assert [h["epoch"] for h in ft.history] == list(range(1, last + 1)) and res["epochs_run"] == last
    assert ft.best["epoch"] == 1


def test_a_label_fraction_smaller_than_a_batch_trains_on_what_it_has(pretrained, tmp_path):
    """A small cohort's 10% of labels can hold fewer rows than the batch (the GPU-size smoke run: about
    50 rows at batch 128): the run takes them all as its batch instead of training no step."""
    cfg = _cfg(pretrained, tmp_path / "small", init="random", label_fraction=0.2, global_batch=128, epochs=2)
    ft = _finetuner(cfg)
    n = int(ft.train.sum())
    assert 0 < n < 128 and ft.batch == n and ft.per_epoch == 1
    res = ft.run(progress=False)
    assert ft.step == 2 and res["epochs_run"] == 2


def test_workers_null_takes_the_default_loader_workers(pretrained, tmp_path):
    """workers: null is data.loader_workers' default (the cores less one), as in pretraining: the GPU size
    sets it, where two workers would crop 128 volumes a step."""
    from train import data

    ft = _finetuner(_cfg(pretrained, tmp_path / "w", workers="null", epochs=1))
    assert ft.cfg.workers is None and ft.loader(0)[1].num_workers == data.loader_workers(None)


def test_val_every_scores_by_steps_and_keeps_the_best_state(pretrained, tmp_path):
    """With val_every the run is scored every so many optimizer steps (a batch of 128 takes a 10%
    fraction's epoch in a step or two): patience counts scores, the best scored state is what is
    kept, and the checkpoints are numbered by step."""
    import itertools

    cfg = _cfg(pretrained, tmp_path / "steps", init="random", epochs=10, val_every=2, patience=2, warmup_epochs=0)
    ft = _finetuner(cfg)
    scores = itertools.chain([0.5, 0.9, 0.6, 0.6, 0.95], itertools.repeat(0.1))
    seen = {}

    def scripted():
        v = {"epoch": finetune_schedule.epochs_of(ft.step, ft.per_epoch), "step": ft.step, "balanced_accuracy": next(scores),
             "auroc": 0.5}
        seen[ft.step] = {k: t.clone() for k, t in ft.model.encoder.state_dict().items()}
        return v

    ft.validate = scripted
    half = ft.total // 2  # patience is spent only in the run's second half
    ft.run(progress=False)
    steps = [h["step"] for h in ft.history]
    assert steps[:5] == [2, 4, 6, 8, 10] and all(s % 2 == 0 for s in steps)
    best = ft.best["step"]
    assert best == 10 and ft.stopped() and steps[-1] > max(best, half)  # stopped after two stale scores past half
    saved = checkpoint.load(ft.folder.finetuned())
    assert saved["step"] == best and all(torch.equal(saved["target"][k], seen[best][k]) for k in seen[best])
    assert checkpoint.newest_whole(ft.ckpt_dir).endswith(f"step_{steps[-1]:07d}.pt")


def test_predict_scores_each_real_row_once(pretrained, tmp_path):
    """One scorer for a run's own head (validation and finish): a probability row per real row, padding
    dropped."""
    ft = _finetuner(_cfg(pretrained, tmp_path / "pred", init="random", eval_batch=2))
    torch.manual_seed(0)
    with torch.no_grad():  # the head starts at zero (every row 0.5): classes that move with the input
        for p in ft.model.head.parameters():
            p.normal_(0.0, 5.0)
    mask = ft.split != "train"
    want = ft.predict(mask)
    assert want.shape == (int(mask.sum()), ft.spec["classes"]) and np.allclose(want.sum(1), 1, atol=1e-5)
    assert not np.allclose(want, want[0])  # each row its own input


def _saved_at_epoch(cfg: FinetuneConfig, epochs: int) -> finetune.Finetuner:
    """A run on one process saved as if it had trained `epochs` whole epochs (nothing trained: the
    position is what a resume reads)."""
    ft = _finetuner(cfg)
    ft.step, ft.epoch = epochs * ft.per_epoch, epochs
    ft.history = [{"epoch": epochs, "step": ft.step, "balanced_accuracy": 0.5, "auroc": 0.5, "loss": 1.0}]
    ft.save()
    ft.writer.wait()
    return ft


def _on_two_processes(cfg: FinetuneConfig) -> finetune.Finetuner:
    """The run as rank 0 of two processes builds it: the position conversion only, no process group."""
    return finetune.Finetuner(cfg, runtime.Runtime(kind="cpu", device=torch.device("cpu"), world=2))


def test_a_run_resumed_on_another_process_count_keeps_its_global_batch_and_its_steps(pretrained, tmp_path):
    """Stopped after epoch 2 of 6 on one process and resumed on two, each process takes half of the
    global batch: an optimizer step is the same 4 volumes, an epoch the same steps, and the run
    continues at epoch 2 with the schedule where it was, step-scored (val_every) or not."""
    for scored in (0, 2):
        cfg = _cfg(pretrained, tmp_path / f"ft{scored}", epochs=6, val_every=scored)
        one = _saved_at_epoch(cfg, 2)
        two = _on_two_processes(cfg)
        assert (one.batch, two.batch) == (4, 2) and two.per_epoch == one.per_epoch and two.total == one.total
        assert (two.epoch, two.step) == (2, 2 * one.per_epoch), (two.epoch, two.step, two.total)


def test_a_global_batch_the_processes_cannot_split_is_refused_naming_the_key(pretrained, tmp_path):
    with pytest.raises(ConfigError, match=r"global_batch.*3 does not divide over 2"):
        _on_two_processes(_cfg(pretrained, tmp_path / "ft", global_batch=3))


def test_a_run_saved_with_a_per_process_batch_resumes_as_the_global_batch_it_made(pretrained, tmp_path):
    """Runs made before the fine-tuning batch became the global one saved `batch_size` (per process)
    in their settings: read as batch x processes, such a run of batch 2 on two processes resumes
    under global_batch 4 on one."""
    cfg = _cfg(pretrained, tmp_path / "ft", epochs=6)
    one = _saved_at_epoch(cfg, 2)
    uri, st = one.newest_checkpoint()
    settings = {k: v for k, v in st["finetune"]["settings"].items() if k != "global_batch"}
    st["finetune"]["settings"] = {**settings, "batch_size": 2}
    st["layout"] = {"batch": 2, "world": 2}             # the batch split's key in those checkpoints
    del st["batch_split"]
    checkpoint.write(st, uri)
    again = _finetuner(cfg)
    assert (again.epoch, again.step) == (2, 2 * one.per_epoch)


@pytest.mark.slow  # two processes under torchrun (gloo), about 40 s on 2 cores: the heavy lane
def test_a_one_process_run_resumes_under_torchrun_at_its_epoch(pretrained, tmp_path):
    """The resume above end to end: saved after epoch 2 of 3 on one process, resumed by two under
    torchrun (each taking half of the global batch), it trains epoch 3 alone and reports 3 epochs."""
    from conftest import free_port

    out = tmp_path / "ft"
    _saved_at_epoch(_cfg(pretrained, out, epochs=3), 2)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "evals.finetune", "--no-progress", "--ckpt", str(pretrained), f"out={out}",
                        *QUICK, "epochs=3"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "resume: batch 4 x 1 process(es) -> 2 x 2" in r.stdout and "at epoch 2" in r.stdout
    m = json.loads((out / "diabetic" / "metrics.json").read_text())
    assert [h["epoch"] for h in m["history"]] == [2, 3] and m["epochs_run"] == 3


def test_a_resumed_finetune_reports_the_start_it_trained_from(signal_run, tmp_path):
    """CKPT=<run>/checkpoints/latest.pt, and the pretraining saves again before the fine-tuning run
    resumes: metrics.json's `from` is the checkpoint the run trained from (step 2), not the one
    latest.pt points at now (step 4)."""
    from evals import finetune
    from evals.config import FinetuneConfig

    pretrained = Path(shutil.copytree(signal_run / "checkpoints", tmp_path / "checkpoints"))  # it saves into it
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
