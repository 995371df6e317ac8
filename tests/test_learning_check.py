"""`make learning-check` end to end on a tiny generated cohort with a few pretraining steps:
the report is produced, both tasks carry a paired difference with its interval (the supervised
reference too), the label-efficiency curve and the held-out scanners are scored, each question
has its own verdict line, and a re-run does only what is left."""
import json
import re
import typing

import numpy as np
import pytest

from conftest import run_cli, tiny_train_args
from check import learning_check, report, result_rows, run_names, verdicts
from evals import probe
from check.config import FRACTIONS, SIZES, CheckConfig
from evals.config import ProbeConfig
from octfm import cli, config, procs

PROBE = ["--probe", "epochs=5", "--probe", "lrs=[1e-3]", "--probe", "weight_decays=[0.0]"]


@pytest.mark.slow  # 40 s on 2 cores: the heavy lane (make test-heavy)
def test_learning_check_end_to_end_and_resumes(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    train = [a for a in tiny_train_args(tmp_path, tmp_path, max_steps=4, ckpt_every=4)
             if not a.startswith(("name=", "runs_dir=", "data.cache="))]
    train = [a for a in train if not a.startswith("eval_every=")] + ["eval_every=2"]
    budget = [x for kv in ("epochs=1", "frozen_epochs=0", "global_batch=2", "workers=0", "patience=0")
              for x in ("--finetune-arg", kv)]  # the references' too: they are `make finetune` from random init
    args = ["--work", str(work), "--out", str(out), "--participants", "16", "--bootstrap", "50", "--set", "random_draws=2",
            "--curve", *PROBE, *budget, *train]        # --curve: a supervised reference at 10%, 25% and 100%
    r = run_cli("check.learning_check", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "lesions" / "result.json").read_text())
    verdict, efficiency, tuning = r.stdout.strip().splitlines()[-3:]     # one line per question, printed last
    assert [verdict, efficiency, tuning] == verdicts.verdict_lines(res)
    assert tuning.startswith("fine-tuning [lesions]: NOT ASKED: FINETUNE=1")   # a question not asked says how
    assert verdict.startswith("learning-check [lesions]: ") and "pretrained - random-init (mean of 2 draws)" in verdict
    assert res["verdict"] == verdict and res["step"] == 4 and res["cohort_seed"] == 16
    first = res["label_efficiency"]["points"][0]                         # its own line: 10% against its reference
    p10, s10 = first["pretrained"]["balanced_accuracy"], first["supervised"]["balanced_accuracy"]
    assert efficiency == res["label_efficiency"]["verdict"] == (
        f"label efficiency [lesions]: {'PASS' if p10 >= s10 else 'FAIL'}: at 10% of labels frozen pretrained "
        f"{p10:.3f} vs supervised {s10:.3f} (target: pretrained >= supervised)")
    assert "supervised" not in verdict and efficiency in (out / "lesions" / "result.md").read_text()
    for task, classes in (("diabetic", 2), ("study_group", 4)):
        t = res["tasks"][task]
        assert t["classes"] == classes and t["test_participants"] >= 2
        assert set(t["comparisons"]) == {"linear", "attentive", "chosen_on_val", "same_kind_chosen_on_val"}
        for c in t["comparisons"].values():
            lo, hi = c["difference_ci95"]
            assert abs(c["difference"] - (c["pretrained"] - c["random_init"])) < 1e-9
            assert lo <= hi and c["participants"] == t["test_participants"]
        draws = t["comparisons"]["chosen_on_val"]["random_draws"]          # random init: the mean of two draws
        assert [d["draw"] for d in draws] == [1, 2]
        assert abs(t["comparisons"]["chosen_on_val"]["random_init"] - np.mean([d["random_init"] for d in draws])) < 1e-9
    assert res["random_draws"] == 2 and res["random_init_seeds"] == [16501, 16502]   # the cohort's own
    assert res["token_probe"]["features_reused"] == {"pretrained": True, "random_init": True}   # draw 1's grid
    assert verdicts.draws_line(res) in (out / "lesions" / "result.md").read_text()
    assert set(res["stages"]) == {"cohort", "cache", "pretrain", "features", "headline probes", "token probe", "probes",
                                  "supervised features",    # the three references' in one pass
                                  "references and fine-tuning", learning_check.CURVE_JOB,  # at once
                                  *(f"fine-tuning (random init), {f} of labels" for f in ("100%", "25%", "10%"))}
    for task in ("diabetic", "study_group"):                            # the supervised reference, against random
        ref = res["supervised_reference"][task]
        assert abs(ref["difference"] - (ref["supervised"] - ref["random_init"])) < 1e-9
        assert ref["random_init"] == res["tasks"][task]["comparisons"]["chosen_on_val"]["random_init"]
    points = res["label_efficiency"]["points"]                           # nested subsets, three encoders each
    assert [p["fraction"] for p in points] == [0.1, 0.25, 1.0]
    assert [p["participants"] for p in points] == sorted(p["participants"] for p in points)
    full = res["tasks"]["diabetic"]["comparisons"]["chosen_on_val"]
    assert points[-1]["pretrained"]["balanced_accuracy"] == full["pretrained"]   # 100% is the main table's probe
    for p in points:
        d = p["pretrained_minus_supervised"]
        assert abs(d["difference"] - (p["pretrained"]["balanced_accuracy"] - p["supervised"]["balanced_accuracy"])) < 1e-9
    assert res["training"]["steps"] == 4
    trained = res["supervised_training"]                                 # each reference: make finetune from scratch
    assert set(trained) == {"100%", "25%", "10%"} and all(t["epochs_run"] == 1 for t in trained.values())
    assert report.reference_training_line(trained) in (out / "lesions" / "result.md").read_text()
    assert [r["step"] for r in res["online_probe"]] == [0, 2, 4]          # the online-probe curve, floor first
    assert all(0 <= r[f"probe/{t}/knn_bal_acc"] <= 1 for r in res["online_probe"] for t in ("diabetic", "study_group"))
    for name in ("result.md", "result.png"):
        assert (out / "lesions" / name).stat().st_size > 0
    assert "## diabetic" in (out / "lesions" / "result.md").read_text()
    probed = run_cli("evals.probe", f"run={res['run']}", "bootstrap=50", *PROBE[1::2])    # as the demo probes its run
    assert probed.returncode == 0, probed.stderr[-3000:]
    line = run_cli("check.learning_check", "--line", res["run"])    # the demo's last line, from the probe reports
    assert line.returncode == 0 and len(line.stdout.strip().splitlines()) == 1
    assert re.search(r"diabetic \d\.\d\d \[\d\.\d\d, \d\.\d\d\] vs \d\.\d\d \[", line.stdout)

    tune = ["--finetune", "--finetune-fraction", "0.5", "--finetune-fraction", "1.0",   # 50%: off the probes' curve
            "--finetune-seeds", "2"]                                  # two training seeds per init
    again = run_cli("check.learning_check", *args, *tune)            # a re-run, with the fine-tuning rows added
    assert again.returncode == 0, again.stderr[-3000:]
    assert "cohort in" in again.stdout and "reused" in again.stdout
    assert "nothing to do" in again.stdout                       # the run is at max_steps already
    assert re.search(r"cache: \d+ rows in shard 0/1: \d+ reused, 0 processed", again.stdout)
    res2 = json.loads((out / "lesions" / "result.json").read_text())
    assert res2["features_reused"] == {"pretrained": True, "random_init": True, "random_init_2": True}
    assert res2["tasks"] == res["tasks"] and res2["label_efficiency"] == res["label_efficiency"]
    tuned = res2["finetune"]["points"]                                   # fine-tuned from the checkpoint and from random
    assert [p["fraction"] for p in tuned] == [0.5, 1.0]
    verdict_lines = res2["finetune"]["verdict"].splitlines()       # the target, then one reading per fraction
    assert len(verdict_lines) == 1 + len(tuned)
    printed = "\n".join(verdicts.verdict_lines(res2)).splitlines()   # learns, label efficiency, then fine-tuning's
    assert again.stdout.strip().splitlines()[-len(printed):] == printed and printed[-len(verdict_lines):] == verdict_lines
    assert printed[:2] == [res2["verdict"], res2["label_efficiency"]["verdict"]] == verdicts.verdict_lines(res)[:2]
    chosen = res["tasks"]["diabetic"]["comparisons"]["chosen_on_val"]["pretrained"]
    assert tuned[-1]["frozen"]["balanced_accuracy"] == chosen       # the frozen probe (val's head) it is set against
    for p in tuned:
        for key, a, b in (("pretrained_minus_random_init", "pretrained", "random_init"),
                          ("finetuned_minus_frozen", "pretrained", "frozen")):
            assert abs(p[key]["difference"] - (p[a]["balanced_accuracy"] - p[b]["balanced_accuracy"])) < 1e-9
    assert "supervised" not in tuned[0]                                  # no reference trained on 50% of labels
    full_sup = points[-1]["supervised"]["balanced_accuracy"]             # 100%: the reference on the same labels
    assert tuned[-1]["supervised"]["balanced_accuracy"] == full_sup
    d = tuned[-1]["finetuned_minus_supervised"]["difference"]
    assert abs(d - (tuned[-1]["pretrained"]["balanced_accuracy"] - full_sup)) < 1e-9
    assert res2["finetune"]["against_supervised"].startswith("fine-tuned at 100% of labels vs the supervised")
    assert res2["finetune"]["against_supervised"] in again.stdout
    assert {f"fine-tuning ({i} init), {f} of labels" for i in ("pretrained", "random") for f in ("50%", "100%")} \
        <= set(res2["stages"])
    t = learning_check.training_seeds(16, 0, 2)                 # the cohort's own training seeds
    assert res2["training_seeds"] == t == [16000, 16001] and res["training_seeds"] == [16000]
    for tag in (run_names.finetune_tag("random", 0.5, t[0], 0), run_names.finetune_tag("random", 0.5, t[1], 0)):
        assert (tmp_path / "out" / res["run"].rsplit("/", 1)[-1] / "finetune" / tag / "diabetic" / "metrics.json").exists()
    assert all(p["train_seeds"] == 2 and len(p["per_seed"]["random_init"]) == 2 for p in tuned)
    runs = res2["finetune"]["runs"]                      # each run's val per epoch: a lent GPU's call returns only $OUT
    assert len(runs) == 8 and {(r["fraction"], r["init"], r["train_seed"]) for r in runs} == \
        {(f, i, s) for f in (0.5, 1.0) for i in ("pretrained", "random") for s in t}
    rand = next(r for r in runs if (r["fraction"], r["init"], r["train_seed"]) == (0.5, "random", t[1]))
    m = json.loads((tmp_path / "out" / res["run"].rsplit("/", 1)[-1] / "finetune" /
                    run_names.finetune_tag("random", 0.5, t[1], 0) / "diabetic" / "metrics.json").read_text())
    assert rand["val"] == [round(h["balanced_accuracy"], 4) for h in m["history"]] and rand["epochs_run"] == 1
    assert rand["best_epoch"] == m["probes"][0]["best_epoch"] and rand["head"] == m["probes"][0]["head"]
    assert report.tuned_line(rand) in (out / "lesions" / "result.md").read_text()
    assert f"fine-tuning (pretrained init, training seed {t[1]}), 50% of labels" in res2["stages"]
    # the from-scratch run at 100% is the reference there: one run for both rows (its features are the reference's)
    assert sum(s.startswith("fine-tuning (random init), 100%") for s in res2["stages"]) == 1

    headline = [a for a in args if a != "--curve"]                     # the scanners cue trains no reference
    scanners = run_cli("check.learning_check", *headline, "--cue", "scanners")   # the same cohort and run, held out
    assert scanners.returncode == 0, scanners.stderr[-3000:]
    assert "nothing to do" in scanners.stdout
    sres = json.loads((out / "scanners" / "result.json").read_text())
    assert sres["run"] == res["run"] and sres["protocol"] == "scanners" and not sres["supervised_reference"]
    assert 2 <= len(sres["per_scanner"]) <= 4                             # of the four devices, those with test rows
    assert sres["tasks"]["diabetic"]["test_rows"] == res["tasks"]["diabetic"]["test_rows"]  # each test row once


def test_each_generated_cohort_fine_tunes_from_its_own_training_seeds():
    """A training seed sets the random start's weights, so two cohorts that shared training seeds shared their
    from-scratch draws; a generated cohort's runs draw their own, a SOURCE root keeps the probes'."""
    a, b = (learning_check.training_seeds(cohort, probe_seed=0, n=3) for cohort in (301, 307))
    assert a == [301000, 301001, 301002] and b == [307000, 307001, 307002]
    assert learning_check.training_seeds(None, probe_seed=0, n=3) == [None, 1, 2]   # real data: as before
    assert learning_check.training_seeds(None, probe_seed=5, n=2) == [None, 6]
    tags = {run_names.finetune_tag("random", 0.1, t, 0) for t in a + b}
    assert len(tags) == 6


def test_each_generated_cohort_draws_its_own_random_init_encoders(monkeypatch, tmp_path):
    """The frozen rows' random-init encoders were once probe seed + 1..n on every cohort, so a replication
    across cohorts replicated only the pretrained side. A generated cohort draws its own, apart from its
    fine-tuning starts; real data and `make probe` keep the probes' seed + d."""
    def seeds(cohort):
        cfg = config.from_dict(ProbeConfig, {"baseline_draws": 3, "baseline_seed": learning_check.baseline_seed(cohort)})
        return probe.draw_seeds(cfg)

    a, b = seeds(301), seeds(307)
    assert a == [301501, 301502, 301503] and b == [307501, 307502, 307503]
    assert not set(a) & set(learning_check.training_seeds(301, probe_seed=0, n=3))   # nor a fine-tuning start
    assert seeds(None) == [1, 2, 3] == probe.draw_seeds(config.from_dict(ProbeConfig, {"baseline_draws": 3}))
    assert config.load(ProbeConfig, "configs/probe.yaml", []).baseline_seed is None     # make probe: as before

    def draws_from(cohort, *probe_args):
        return learning_check.probe_config(tmp_path / "cache", 10, 3, "cpu", probe_args, cohort).baseline_seed

    assert draws_from(301) == 301500 and draws_from(None) is None
    assert draws_from(301, "baseline_seed=7") == 7                                      # --probe has the last word

    class Called(Exception):
        pass

    def raises(*args, **kw):
        raise Called(*args, *kw.values())

    monkeypatch.setattr(learning_check, "probe_config", raises)      # the cohort whose draws check() asks for
    for source, asked in ((None, 301), (str(tmp_path / "real"), None)):
        with pytest.raises(Called) as e:
            learning_check.check(CheckConfig(source=source, work=str(tmp_path / "work"), out=str(tmp_path / "out"),
                                             seed=301))
        assert e.value.args[-1] == asked
    assert not (tmp_path / "work").exists()                          # asked before any work


def test_the_fine_tuning_rows_set_fine_tuning_against_the_frozen_head_val_chose():
    """'fine-tuned >= frozen' compares with the frozen probe's chosen head."""
    assert result_rows.frozen_probe({"attentive": {"prob": "A"}, "linear": {"prob": "L"},
                                        "chosen_on_val": {"prob": "L"}}) == "L"
    def point(fraction, ft, frozen):
        return {"fraction": fraction, "pretrained": {"balanced_accuracy": ft}, "random_init": {"balanced_accuracy": 0.6},
                "frozen": {"balanced_accuracy": frozen},
                "pretrained_minus_random_init": {"difference": ft - 0.6, "difference_ci95": [0.02, 0.18]},
                "finetuned_minus_frozen": {"difference": ft - frozen, "difference_ci95": [-0.01, 0.1]}}

    verdict = verdicts.finetune_verdict([point(0.1, 0.70, 0.65), point(1.0, 0.8, 0.82)])
    first, *lines = verdict.splitlines()
    assert "PASS" in first and "target at 10% of labels" in first
    # a reading at 10% and at 100% of labels, each against from scratch and the frozen probe with intervals
    assert lines[0].startswith("- 10% of labels: fine-tuned 0.700, from scratch 0.600, frozen probe (head chosen on val) "
                               "0.650; pretrained - random-init +0.100 [+0.020, +0.180], fine-tuned - frozen +0.050")
    assert lines[1].startswith("- 100% of labels: fine-tuned 0.800") and "fine-tuned - frozen -0.020" in lines[1]
    assert "FAIL" in verdicts.finetune_verdict([point(0.1, 0.70, 0.75)])  # below the frozen probe


def test_fine_tuned_rows_are_means_over_training_seeds():
    """With several training seeds per init a fine-tuned row is their mean, and its
    differences are means of paired differences (every seed scored on each resample); one seed
    gives the single run's numbers."""
    import numpy as np

    from check import probes as check_probes
    from evals import probe_metrics as pm

    rng = np.random.default_rng(0)
    rows = [{"label": 3 * ((i // 6) % 2), "split": ["train", "val", "test"][(i // 2) % 3],
             "participant_id": f"p{i // 2}"} for i in range(240)]   # two rows (eyes) per participant
    y = check_probes.task_arrays("diabetic", rows)[0]
    right = lambda q: np.eye(2)[np.where(rng.random(len(y)) < q, y, 1 - y)]  # noqa: E731
    tuned = {0.1: {"pretrained": [right(0.8), right(0.7)], "random": [right(0.6), right(0.5)]}}
    frozen = {0.1: right(0.65)}
    fs = check_probes.folds(rows, "splits")
    te = fs[0][3]
    ba = lambda p: check_probes.score("diabetic", rows, p, te, 0, 0)["balanced_accuracy"]  # noqa: E731
    [row] = result_rows.finetune_rows(rows, tuned, frozen, fs, 100, 0)
    assert row["train_seeds"] == 2
    assert row["per_seed"]["pretrained"] == [ba(p) for p in tuned[0.1]["pretrained"]]
    assert row["pretrained"]["balanced_accuracy"] == pytest.approx(np.mean(row["per_seed"]["pretrained"]))
    assert row["pretrained_minus_random_init"]["difference"] == pytest.approx(
        np.mean(row["per_seed"]["pretrained"]) - np.mean(row["per_seed"]["random_init"]))
    assert row["finetuned_minus_frozen"]["difference"] == pytest.approx(np.mean(row["per_seed"]["pretrained"]) - ba(frozen[0.1]))
    lo, hi = row["pretrained_minus_random_init"]["difference_ci95"]
    assert lo < row["pretrained_minus_random_init"]["difference"] < hi
    [one] = result_rows.finetune_rows(rows, {0.1: {k: v[:1] for k, v in tuned[0.1].items()}}, frozen, fs, 100, 0)
    a, b = (tuned[0.1][k][0][te] for k in ("pretrained", "random"))     # one seed: the paired bootstrap, by hand
    groups, yt = np.array([r["participant_id"] for r in rows])[te], y[te]
    diffs = [pm.balanced_accuracy(yt[i], a[i].argmax(1), 2) - pm.balanced_accuracy(yt[i], b[i].argmax(1), 2)
             for i in pm.participant_resamples(groups, 100, 0)]
    d = one["pretrained_minus_random_init"]
    assert d["difference"] == pytest.approx(pm.balanced_accuracy(yt, a.argmax(1), 2) - pm.balanced_accuracy(yt, b.argmax(1), 2))
    assert d["difference_ci95"] == pytest.approx(pm.ci95(diffs))
    per = np.subtract(row["per_seed"]["pretrained"], row["per_seed"]["random_init"])
    assert f"mean of 2 training seeds (per seed {per[0]:+.3f}, {per[1]:+.3f}; 2 of 2 above 0; mean with the seeds " \
        in verdicts.finetune_verdict([row])


def test_the_seed_resampled_interval_widens_with_the_seeds_spread_only():
    """The mean over training seeds, its interval drawing seeds as well as participants. Seeds that
    agree give the fixed-seed interval exactly (the same participant resamples); seeds that disagree widen it."""
    import numpy as np

    from check import probes as check_probes

    rng = np.random.default_rng(1)
    rows = [{"label": 3 * ((i // 6) % 2), "split": ["train", "val", "test"][(i // 2) % 3],
             "participant_id": f"p{i // 2}"} for i in range(600)]
    y = check_probes.task_arrays("diabetic", rows)[0]
    right = lambda q: np.eye(2)[np.where(rng.random(len(y)) < q, y, 1 - y)]  # noqa: E731
    te = check_probes.folds(rows, "splits")[0][3]
    a, b = right(0.8), right(0.6)
    same = check_probes.seed_resampled_paired("diabetic", rows, [a, a, a], [b, b, b], te, 200, 0)
    fixed = check_probes.mean_paired("diabetic", rows, [a, a, a], [b, b, b], te, 200, 0)
    assert same["difference"] == pytest.approx(fixed["difference"])
    assert same["difference_ci95"] == pytest.approx(fixed["difference_ci95"])
    pa, pb = [right(0.9), right(0.6), right(0.6)], [right(0.5), right(0.6), right(0.8)]   # per seed about +0.4, 0, -0.2
    spread = check_probes.seed_resampled_paired("diabetic", rows, pa, pb, te, 200, 0)
    held = check_probes.mean_paired("diabetic", rows, pa, pb, te, 200, 0)
    ba = lambda p: check_probes.score("diabetic", rows, p, te, 0, 0)["balanced_accuracy"]  # noqa: E731
    assert spread["per_seed"] == pytest.approx([ba(p) - ba(q) for p, q in zip(pa, pb)])
    assert spread["difference"] == pytest.approx(held["difference"])
    width = lambda c: c["difference_ci95"][1] - c["difference_ci95"][0]  # noqa: E731
    assert width(spread) > 2 * width(held)
    with pytest.raises(ValueError, match="two or more runs"):
        check_probes.seed_resampled_paired("diabetic", rows, [a], [b], te, 10, 0)
    tuned = {0.1: {"pretrained": pa, "random": pb}}
    [row] = result_rows.finetune_rows(rows, tuned, {0.1: right(0.7)}, check_probes.folds(rows, "splits"), 200, 0)
    assert row["pretrained_minus_random_init_seeds_resampled"]["difference_ci95"] == pytest.approx(spread["difference_ci95"])
    assert "mean with the seeds resampled too " + verdicts._diff(spread) in verdicts.finetune_verdict([row])
    [one] = result_rows.finetune_rows(rows, {0.1: {k: v[:1] for k, v in tuned[0.1].items()}}, {0.1: right(0.7)},
                                     check_probes.folds(rows, "splits"), 50, 0)
    assert "pretrained_minus_random_init_seeds_resampled" not in one


def test_zero_fine_tuning_seeds_are_refused_naming_the_flag():
    from octfm import cli

    with pytest.raises(cli.UsageError, match="FT_SEEDS"):
        learning_check.main(["--finetune", "--finetune-seeds", "0"])


FT = ["--finetune", "--finetune-fraction", "0.1", "--finetune-arg", "epochs=1", "--finetune-arg", "frozen_epochs=0",
      "--finetune-arg", "workers=0"]


@pytest.mark.slow  # every GPU-size stage at tiny sizes, about 21 s: the heavy lane, beside make device-check's dry run
def test_the_gpu_size_check_dry_runs_on_the_cpu(tmp_path, capsys):
    """`make learning-check SIZE=gpu` on the CPU, tiny: the GPU size's config with only its size
    shrunk and the device set to the CPU, the volumes resident as on the GPU
    (data.resident=always), the token probe stage, the result files, the supervised reference
    at 10% of labels only (the default: what a lent GPU's call holds), and the reference
    and fine-tuning runs at once in their own processes, as they give one after another. The GPU
    run itself is `make learning-check-device` on a lent machine."""
    gpu_dry_run(tmp_path, "out", capsys)


GPU_TINY = ["--size", "gpu", "--participants", "12", "--bootstrap", "20", "--set", "random_draws=2",
            "device=cpu", "precision=fp32", "data.resident=always", "data.workers=0", "global_batch=4", "max_steps=2",
            "eval_every=0", "ckpt_every=2", "model.dim=32", "model.depth=1", "model.heads=2", "model.pred_dim=16",
            "model.pred_depth=1", "model.pred_heads=2", "optim.warmup_steps=1"]


def gpu_dry_run(tmp_path, out, capsys):
    """The GPU size at once, tiny, on the CPU, with its files and printed lines checked; its result."""
    from train import pretrain

    loaded = []
    real = pretrain.Trainer.load_resident

    def spy(self, progress):
        real(self, progress)
        loaded.append(self.resident is not None and tuple(self.resident.volumes.shape))

    pretrain.Trainer.load_resident = spy
    try:
        assert learning_check.main(["--work", str(tmp_path / "work"), "--out", str(tmp_path / out),
                                    *GPU_TINY, "--label-efficiency", *FT, *PROBE]) == 0  # as make learning-check-device
    finally:
        pretrain.Trainer.load_resident = real
    res = json.loads((tmp_path / out / "lesions" / "result.json").read_text())
    saved = (tmp_path / out / res["run"].rsplit("/", 1)[-1] / "config.yaml").read_text()
    assert res["step"] == 2 and "log_every: 100" in saved    # the GPU size's (the CPU check logs every 50)
    assert len(loaded) == 1 and loaded[0][1:] == (32, 128, 128)            # every train volume on the "device"
    at_once = {"fine-tuning (pretrained init), 10% of labels",  # the from-scratch run is the 10% reference too
               "fine-tuning (random init), 10% of labels", learning_check.CURVE_JOB}
    assert set(res["stages"]) == {"cohort", "cache", "pretrain", "features", "headline probes", "token probe", "probes",
                                  "references and fine-tuning", "supervised features", *at_once}
    assert {k for k, v in res["stages"].items() if v.get("together")} == at_once
    points = {p["fraction"]: p for p in res["label_efficiency"]["points"]}   # frozen rows at every fraction
    assert sorted(points) == [0.1, 0.25, 1.0] and [f for f, p in points.items() if "supervised" in p] == [0.1]
    assert res["supervised_reference"] == {}                                  # no 100% reference: none of its rows
    # the GPU size's fine-tuning keys (a step budget, val scores every 50 steps) come first, the command line's after
    assert res["finetune_args"][:len(SIZES["gpu"].finetune_args)] == list(SIZES["gpu"].finetune_args)
    trained = res["supervised_training"]
    assert list(trained) == ["10%"] and trained["10%"]["val_every"] == 50 and trained["10%"]["patience"] == 4
    assert "(target: pretrained >= supervised)" in res["label_efficiency"]["verdict"] and "supervised" not in res["verdict"]
    assert "Reference training (make finetune from random init" in (tmp_path / out / "lesions" / "result.md").read_text()
    # the headline rows were printed as soon as the features existed, and every row but the token probe's
    # was written before it (a lent GPU's run cut short in the token probe keeps them)
    early = json.loads((tmp_path / out / "lesions" / "result_interim.json").read_text())
    assert early["tasks"] == res["tasks"] and early["label_efficiency"] == res["label_efficiency"]
    assert "token_probe" not in early and "token probe" not in early["stages"] and "probes" in early["stages"]
    assert early["verdict"] == f"{learning_check.BEFORE_TOKENS}: {res['verdict']}"
    printed = capsys.readouterr().out
    assert learning_check.INTERIM in printed   # the headline rows' verdict, printed before the references
    assert res["token_probe"]["scorers"].keys() == {"pretrained", "random_init", "voxels"}
    # its two encoders' tokens came from the features pass (probe.encoder_features' grids): no second pass
    assert res["token_probe"]["features_reused"] == {"pretrained": True, "random_init": True}
    # random init's two draws in the headline's processes and the curve's job alike
    assert res["random_draws"] == 2 and len(res["tasks"]["diabetic"]["comparisons"]["chosen_on_val"]["random_draws"]) == 2
    assert "random-init (mean of 2 draws)" in (tmp_path / out / "lesions" / "result.md").read_text()
    assert res["verdict"] in printed
    return res


@pytest.mark.slow  # the GPU size's dry run twice (about 55 s on 2 cores): the heavy lane
def test_the_gpu_size_check_gives_the_same_rows_one_at_a_time(tmp_path, capsys):
    """`--one-at-a-time` (the CPU size's way; the cohort and cache reused, everything else afresh)
    gives the at-once run's rows."""
    res = gpu_dry_run(tmp_path, "out", capsys)
    assert learning_check.main(["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out2"), "--one-at-a-time",
                                *GPU_TINY, "--label-efficiency", *FT, *PROBE]) == 0
    seq = json.loads((tmp_path / "out2" / "lesions" / "result.json").read_text())
    # each run a stage of its own (the curve's heads then train in the probes stage)
    assert "references and fine-tuning" not in seq["stages"] and {
        "fine-tuning (pretrained init), 10% of labels", "fine-tuning (random init), 10% of labels"} <= set(seq["stages"])
    for key in ("finetune", "label_efficiency", "supervised_training", "tasks"):
        assert seq[key] == res[key], key


def test_jobs_at_once_run_on_the_threads_they_are_given():
    """Stages.together's processes run on the threads asked for: at CPU size one each (decision
    47); at GPU size (0) torch's default, the machine's cores."""
    import torch

    jobs = {"a": (torch.get_num_threads, ()), "b": (torch.get_num_threads, ())}
    assert procs.in_processes(jobs, 2, threads=1) == {"a": 1, "b": 1}
    assert procs.in_processes(jobs, 2, threads=2) == {"a": 2, "b": 2}  # the value given, not always 1


def test_the_size_sets_the_fine_tuning_keys_and_how_many_runs_at_once(monkeypatch):
    """`--size gpu` hands its fine-tuning runs (the references among them) a batch of 128, a step budget
    and val scores by steps, `--size cpu` none, and command-line keys come after the size's; the random
    draws are the size's unless the config sets them (a smoke run's fewer)."""
    seen = []
    monkeypatch.setattr(learning_check, "check", lambda cfg: seen.append(cfg) or {})
    monkeypatch.setattr(learning_check, "markdown", lambda r: "")
    monkeypatch.setattr(learning_check, "verdict_lines", lambda r: [])
    for argv in (["--size", "gpu"], ["--size", "cpu"], ["--size", "gpu", "--finetune-arg", "patience=0"],
                 ["--size", "cpu", "--set", "random_draws=1"], ["--size", "cpu", "--one-at-a-time"]):
        assert learning_check.main(argv) == 0
    assert [c.draws for c in seen] == [5, 3, 5, 1, 3]
    # both sizes run the references at once, the CPU size's processes on one thread each, the GPU size's on
    # torch's default (0); --one-at-a-time: none at once (None)
    assert [c.threads for c in seen] == [0, 1, 0, 1, None]
    gpu = SIZES["gpu"].finetune_args
    assert {"global_batch=128", "max_steps=3700", "val_every=50", "patience=4"} <= set(gpu)
    assert [(c.pretrain_config, c.tuning_args) for c in seen[:3]] == [
        ("configs/pretrain_check_gpu.yaml", gpu), ("configs/pretrain_check.yaml", ()),
        ("configs/pretrain_check_gpu.yaml", (*gpu, "patience=0"))]
    with pytest.raises(cli.UsageError, match="random_draws"):
        learning_check.main(["--set", "random_draws=0"])


def test_the_default_check_trains_no_reference_and_label_efficiency_on_request():
    """The default asks whether pretraining learns (no supervised reference: one costs more than the rest
    of the check); --label-efficiency (LABELS=1) trains the 10% reference, --curve (CURVE=1) all three,
    whichever order they come in."""
    parse = learning_check.command_line
    assert parse([]).reference_fractions == () and parse(["--curve"]).reference_fractions == FRACTIONS
    assert parse(["--label-efficiency"]).reference_fractions == (0.1,)
    assert parse(["--curve", "--label-efficiency"]).reference_fractions == FRACTIONS
    assert parse(["--finetune"]).finetune_fractions == (0.1, 1.0) and parse([]).finetune_fractions == ()
    assert parse(["--finetune-fraction", "0.5"]).finetune_fractions == (0.5,)
    cfg = parse(["--cue", "layers", "--seed", "29", "max_steps=30", "--probe", "epochs=5", "--set", "bootstrap=10"])
    assert (cfg.cue, cfg.seed, cfg.overrides, cfg.probe, cfg.bootstrap) == ("layers", 29, ("max_steps=30",),
                                                                           ("epochs=5",), 10)
    assert parse(["--line", "runs/x"]) == "runs/x"
    hints = typing.get_type_hints(CheckConfig)                            # the typed keys name every cue and size
    assert set(typing.get_args(hints["cue"])) == set(learning_check.CUES)
    assert set(typing.get_args(hints["size"])) == set(SIZES)


def test_an_unknown_check_key_is_refused_by_name():
    with pytest.raises(config.ConfigError, match="unknown key 'random_draw'"):
        learning_check.command_line(["--set", "random_draw=2"])
    with pytest.raises(config.ConfigError, match="unknown key 'curve'"):
        config.from_dict(CheckConfig, {"curve": True})
    with pytest.raises(config.ConfigError, match="reference_fractions.*not on the label-efficiency curve"):
        learning_check.command_line(["--set", "reference_fractions=[0.5]"])
    with pytest.raises(config.ConfigError, match="FT_SEEDS"):                 # fine-tuning seeds without fine-tuning
        learning_check.command_line(["--finetune-seeds", "3"])


def test_the_scanners_cue_refuses_the_questions_it_does_not_ask_by_name():
    """CUE=scanners holds each scanner out in turn and trains no supervised reference or fine-tuning run per
    fold: LABELS=1, CURVE=1, FINETUNE=1 and FT_SEEDS there are refused naming the flag, never dropped in
    silence; the other cues take them."""
    for argv, flag in ((["--label-efficiency"], "LABELS=1"), (["--curve"], "CURVE=1"), (["--finetune"], "FINETUNE=1"),
                       (["--finetune-fraction", "0.5"], "FINETUNE=1"),
                       (["--finetune", "--finetune-seeds", "2"], "FINETUNE=1")):
        with pytest.raises(config.ConfigError, match=f"scanners.*{flag}"):
            learning_check.command_line(["--cue", "scanners", *argv])
        assert learning_check.command_line(["--cue", "layers", *argv]).cue == "layers"
    assert learning_check.command_line(["--cue", "scanners"]).cue == "scanners"   # the question it asks


def test_the_label_efficiency_heads_train_the_full_splits_steps(monkeypatch):
    """probe_all fits every encoder at every label fraction below all labels (and the
    frozen probe a fine-tuning fraction is set against) with the full train split's optimizer
    steps; the all-labels fits, the supervised reference's included, keep `epochs` (min_steps 0);
    the result says how many steps."""
    import math

    import numpy as np

    from evals import probe
    from evals.config import ProbeConfig

    rng = np.random.default_rng(0)
    rows = [{"label": 3 * ((i // 2) % 2), "split": ["train", "train", "val", "test"][(i // 8) % 4],
             "participant_id": f"p{i // 2}"} for i in range(400)]     # two rows (eyes) per participant
    feats = {e: {"pooled": rng.normal(size=(400, 4)).astype(np.float32)} for e in ("pretrained", "random_init")}
    sup = {f: {"pooled": rng.normal(size=(400, 4)).astype(np.float32)} for f in (0.25, 1.0)}
    pcfg = ProbeConfig(heads=["linear"], lrs=[1e-2], weight_decays=[0.0], epochs=2, batch_size=16, bootstrap=20)
    seen = []
    real = probe.fit_and_select_all
    monkeypatch.setattr(probe, "fit_and_select_all", lambda kind, cfg, f, y, split, k, tr, va:  # one per encoder
                        seen.extend([(cfg.min_steps, int(tr.sum()))] * len(f)) or real(kind, cfg, f, y, split, k, tr, va))
    tuned = {0.1: {"pretrained": [np.full((400, 2), 0.5)], "random": [np.full((400, 2), 0.5)]}}
    out = result_rows.probe_all(pcfg, rows, feats, sup, "splits", (0.25, 1.0), 20, tuned)
    n = sum(r["split"] == "train" for r in rows)
    full = 2 * math.ceil(n / 16)                                        # epochs x the full split's batches
    assert [m for m, k in seen if k < n] == [full] * 4                  # 10%: the frozen probe; 25%: three encoders
    # all labels: the headline (2 tasks x 2 encoders) and the reference's row (2 tasks), whose binary fit is
    # also its curve point (the same folds: fitted once)
    assert [m for m, k in seen if k == n] == [0] * 6
    assert out["label_efficiency"]["head_steps"] == [full]
    assert "as many optimizer steps as all labels'" in report.head_steps(out["label_efficiency"])
    seen.clear()
    only_all = result_rows.probe_all(pcfg, rows, feats, {}, "splits", (1.0,), 20)
    assert "head_steps" not in only_all["label_efficiency"] and all(m == 0 for m, _ in seen)


def _note_pid_and_sleep(path: str, seconds: float) -> None:
    """A long job (a supervised reference) that notes its process id first."""
    import os
    import time
    from pathlib import Path

    Path(path).write_text(str(os.getpid()))
    time.sleep(seconds)


def _fail_once_the_sibling_runs(path: str) -> None:
    """A job that fails while its sibling runs."""
    import time
    from pathlib import Path

    while not Path(path).exists():
        time.sleep(0.05)
    raise ValueError("a job failed")


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("how", ["a job fails", "ctrl-c"])
def test_a_failure_among_jobs_at_once_is_raised_at_once_and_ends_the_others(tmp_path, how):
    """A failed job (or Ctrl-C, here raised where the parent waits) is reported
    without waiting for a sibling that runs for a minute (a supervised reference runs tens of
    minutes), and the sibling's process is gone afterwards."""
    import time

    pid = tmp_path / "pid"
    jobs = {"long": (_note_pid_and_sleep, (str(pid), 60))}
    if how == "a job fails":
        jobs["failing"] = (_fail_once_the_sibling_runs, (str(pid),))
        expected, ended = ValueError, None
    else:
        jobs["short"] = (_note_pid_and_sleep, (str(tmp_path / "x"), 0))

        def ended(name, wall, cpu):
            while not pid.exists():
                time.sleep(0.05)
            raise KeyboardInterrupt

        expected = KeyboardInterrupt
    t0 = time.perf_counter()
    with pytest.raises(expected):
        procs.in_processes(jobs, 2, ended)
    assert time.perf_counter() - t0 < 30
    assert _gone(int(pid.read_text()))


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
