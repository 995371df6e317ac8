"""make leaderboard: every checkpoint probed once, a table per run/checkpoint/task, the
choice made on val. Real pretraining runs (subprocesses) on the planted-signal cache."""
import json
import shutil

import pandas as pd
import pytest

from conftest import run_cli, tiny_train_args, train_here
from evals import leaderboard
from evals.probe import ProbeConfig
from octfm import config
from train.metrics import read_metrics

# a small head grid, few epochs and a small bootstrap keep each checkpoint's probe near a second
FAST = ["heads=[linear,attentive]", "lrs=[0.001]", "weight_decays=[0.0,0.1]", "epochs=8", "bootstrap=50"]
TASKS = ("study_group", "diabetic")


def pretrain(cache, root, max_steps: int) -> None:
    """Train (or resume) run `a` up to max_steps, a checkpoint every 2 steps."""
    train_here(*tiny_train_args(cache, root / "runs", name="a", max_steps=max_steps, ckpt_every=2))


def fast_cfg() -> ProbeConfig:
    return config.load(ProbeConfig, "configs/probe.yaml", [*leaderboard.DEFAULTS, *FAST])


@pytest.fixture(scope="module")
def run_a(signal_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("leaderboard")
    pretrain(signal_cache, root, max_steps=4)          # step_0000002.pt, step_0000004.pt (+ latest.txt)
    return root


def stored_mtimes(run) -> dict:
    files = sorted((run / "probe").rglob("*.json")) + sorted((run / "probe").rglob("*.npz"))
    return {f.name: f.stat().st_mtime_ns for f in files}


@pytest.mark.slow  # about 35 s on 2 cores (make test over its time on a slow hour): the heavy lane, which CI runs
def test_every_checkpoint_is_probed_once_and_tabled(run_a, signal_cache):
    run = run_a / "runs" / "a"
    r = run_cli("evals.leaderboard", "--run", str(run), "--config", "configs/probe.yaml", "--no-progress", *FAST)
    assert r.returncode == 0, r.stderr
    assert "probed 2 checkpoint(s) (a@2, a@4)" in r.stdout and "best a study_group: step" in r.stdout

    pretrain(signal_cache, run_a, max_steps=6)          # resumes at step 4: a third checkpoint appears
    out = leaderboard.run([str(run)], fast_cfg(), progress=False)
    assert out["probed"] == [(str(run), 6)] and out["reused"] == 2
    table = out["table"]
    assert sorted(table["step"].unique()) == [2, 4, 6]
    for task in TASKS:
        t = table[table["task"] == task]
        assert len(t) == 3 and sorted(t["step"]) == [2, 4, 6]
        for split in ("val", "test"):
            for m in ("balanced_accuracy", "auroc"):
                v, lo, hi = t[f"{split}_{m}"], t[f"{split}_{m}_ci95_lo"], t[f"{split}_{m}_ci95_hi"]
                assert v.between(0, 1).all() and (lo <= v + 1e-9).all() and (v <= hi + 1e-9).all()
        devices = leaderboard.devices_of(t)
        assert len(devices) >= 2 and t[[f"test_balanced_accuracy@{d}" for d in devices]].notna().all().all()
        assert t["n_test"].sum() == sum(t[f"test_n@{d}"].sum() for d in devices)
    train_m, _ = read_metrics(run)
    for _, row in table.iterrows():                     # the pretraining metrics logged at that step
        assert row["pretrain_loss"] == pytest.approx(train_m[row["step"]]["loss"])
        assert row["pretrain_rankme"] == pytest.approx(train_m[row["step"]]["rankme"])
    stored = sorted(p.name for p in (run / "probe" / "leaderboard").glob("*.json"))
    assert stored == [f"step_{s:07d}.json" for s in (2, 4, 6)]  # latest.pt (step 6 through the pointer) is not probed again

    on_disk = pd.read_parquet(run / "leaderboard.parquet")
    assert len(on_disk) == 6 and on_disk["best"].sum() == 2
    assert (run / "leaderboard.png").stat().st_size > 0
    md = (run / "leaderboard.md").read_text()
    assert md.count("**best**") == 2 and "## study_group" in md and "Per test device" in md
    best = json.loads((run / "best_checkpoint.json").read_text())
    assert best["selected_on"] == "val"
    for task in TASKS:
        t = table[table["task"] == task]
        assert best["tasks"][task]["val_balanced_accuracy"] == pytest.approx(t["val_balanced_accuracy"].max())
        assert best["tasks"][task]["ckpt"].endswith(f"step_{best['tasks'][task]['step']:07d}.pt")

    before = stored_mtimes(run)
    again = leaderboard.run([str(run)], fast_cfg(), progress=False)
    assert again["probed"] == [] and again["reused"] == 3
    assert stored_mtimes(run) == before                 # no result and no feature file rewritten
    pd.testing.assert_frame_equal(again["table"], table)


def set_scores(run, val: dict, test: dict) -> None:
    """Rewrite the stored per-checkpoint results so every pretrained head of step s scores
    val[s] on val and test[s] on test (AUROC equal everywhere, so it breaks no tie)."""
    for path in sorted((run / "probe" / "leaderboard").glob("step_*.json")):
        rec = json.loads(path.read_text())
        for res in rec["result"]["results"].values():
            for p in res["probes"]:
                if p["encoder"] == "pretrained":
                    p["val_balanced_accuracy"] = p["val"]["balanced_accuracy"] = val[rec["step"]]
                    p["test"]["balanced_accuracy"] = test[rec["step"]]
                    p["val_auroc"] = p["val"]["auroc_macro_ovr"] = p["test"]["auroc_macro_ovr"] = 0.5
        path.write_text(json.dumps(rec))


def test_the_choice_follows_val_never_test(run_a, tmp_path):
    """Two runs on one board; in the copy, val and test disagree about the best checkpoint."""
    a = run_a / "runs" / "a"
    leaderboard.run([str(a)], fast_cfg(), progress=False)   # whatever was not probed yet
    b = tmp_path / "b"
    shutil.copytree(a, b)                                     # copy2: names, sizes and times survive
    steps = sorted(json.loads(p.read_text())["step"] for p in (b / "probe" / "leaderboard").glob("step_*.json"))
    first, last = steps[0], steps[-1]
    low, high = 0.3, 0.9

    set_scores(b, val={s: high if s == first else low for s in steps}, test={s: high if s == last else low for s in steps})
    out = leaderboard.run([str(b), str(a)], fast_cfg(), progress=False)   # the table goes beside b
    assert out["probed"] == []                                # a moved run keeps its stored results
    best = json.loads((b / "best_checkpoint.json").read_text())["tasks"]
    for task in TASKS:
        assert best[task]["step"] == first and best[task]["val_balanced_accuracy"] == high
        assert best[task]["test_balanced_accuracy"] == low    # reported on test, whatever test says
        assert best[task]["ckpt"] == str(b / "checkpoints" / f"step_{first:07d}.pt")
    combined = pd.read_parquet(tmp_path / "leaderboard" / "leaderboard.parquet")
    assert set(combined["run_name"]) == {"a", "b"} and len(combined) == 2 * len(steps) * len(TASKS)
    assert combined["best"].sum() == 2 * len(TASKS)

    set_scores(b, val={s: high if s == last else low for s in steps}, test={s: high if s == first else low for s in steps})
    leaderboard.run([str(b)], fast_cfg(), progress=False)
    best = json.loads((b / "best_checkpoint.json").read_text())["tasks"]
    assert all(best[task]["step"] == last and best[task]["test_balanced_accuracy"] == low for task in TASKS)

    (b / "checkpoints" / f"step_{last:07d}.pt").unlink()     # pruned: stays on the board, cannot be chosen
    out = leaderboard.run([str(b)], fast_cfg(), progress=False)
    assert out["probed"] == [] and sorted(out["table"]["step"].unique()) == steps
    assert not out["table"].loc[out["table"]["step"] == last, "ckpt_exists"].any()
    best = json.loads((b / "best_checkpoint.json").read_text())["tasks"]
    assert all(best[task]["step"] == first for task in TASKS)  # the others tie on val: the earliest wins
    assert "(pruned)" in (b / "leaderboard.md").read_text()

    other = config.load(ProbeConfig, "configs/probe.yaml", [*leaderboard.DEFAULTS, *FAST, "epochs=6"])
    out = leaderboard.run([str(b)], other, progress=False)   # new settings: every checkpoint on disk again
    assert [s for _, s in out["probed"]] == steps[:-1] and last not in set(out["table"]["step"])


def test_a_checkpoint_cut_short_is_skipped_by_probe_and_leaderboard(run_a, tmp_path, capsys):
    from evals import probe
    from train import checkpoint

    run = tmp_path / "a"
    shutil.copytree(run_a / "runs" / "a", run)
    ckdir = run / "checkpoints"
    newest = checkpoint.list_steps(str(ckdir))[-1]   # 4, or 6 once the test above has resumed the run
    whole = ckdir / f"step_{newest:07d}.pt"
    torn = ckdir / "step_0000099.pt"   # a save a kill interrupted, or a copy still in flight
    torn.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert checkpoint.is_whole(str(whole)) and not checkpoint.is_whole(str(torn))
    assert probe.resolve_checkpoint(ProbeConfig(run=str(run))) == str(whole)
    assert f"checkpoint {torn} is cut short" in capsys.readouterr().out
    done, todo = leaderboard.Board(fast_cfg()).plan(str(run))
    assert 99 not in done and 99 not in [step for step, _, _ in todo]
    assert f"leaderboard: skipping {torn}: cut short" in capsys.readouterr().err


def test_a_probe_key_added_later_leaves_stored_results_valid_at_its_default():
    """`baseline_seed` (a cohort's own random-init draws) came after leaderboards were stored: at its default (None) it stays out
    of the settings key, so no stored result goes stale; set, it is in the key."""
    default = config.load(ProbeConfig, "configs/probe.yaml", [])
    assert "baseline_seed" not in leaderboard.result_settings(default)
    seeded = config.load(ProbeConfig, "configs/probe.yaml", ["baseline_seed=5"])
    assert leaderboard.result_settings(seeded)["baseline_seed"] == 5
    assert leaderboard.settings_key(seeded) != leaderboard.settings_key(default)
