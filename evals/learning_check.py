"""`make learning-check`: does `make pretrain` learn something a random encoder lacks?

On a cohort where the answer is known (default: the lesion cohort `ingest.synth` generates,
whose class lives only in local macular lesions; `SOURCE=` takes any AI-READI-shaped root whose
participants.tsv carries labels), this builds the cache, pretrains a small recipe
(configs/pretrain_check.yaml, `ARGS` overrides its keys), and probes the final checkpoint, a
random-init encoder of the same architecture and the majority class with the same heads and
the same participant-level splits. It reports test balanced accuracy pretrained minus random
with a paired bootstrap interval over participants, for both tasks, and the online-probe curve
of the run when it logged one. Every stage is resumable: a re-run does only what is left.
Writes <out>/result.json, result.md and result.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import resource
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from cache import build as cache_build
from cache.config import CacheConfig
from evals import probe, supervised
from evals import probe_metrics as pm
from evals.config import ProbeConfig
from ingest import synth
from manifests.aireadi import TASKS
from octfm import cli, config, fsio, plots
from train import checkpoint, metrics, pretrain
from train.config import TrainConfig
from train.model import objective
from train.run_folder import RunFolder

COHORT = synth.SynthConfig(participants=1000, scale=4, seed=16, lesions=6.0, bad_files=False, unlabeled=0)
CACHE_ARGS = ["preprocess.target_shape=[32,128,128]"]
TARGET = 0.10        # pretrained minus random, binary task, with the paired interval above 0
BINARY, MULTI = "diabetic", "study_group"


class Stages:
    """Wall and CPU seconds (this process and its children) per stage, for the summary."""

    def __init__(self):
        self.times: dict[str, dict] = {}

    @staticmethod
    def _cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    def run(self, name: str, fn):
        print(f"learning-check: {name} ...", flush=True)
        t0, c0 = time.perf_counter(), self._cpu()
        out = fn()
        self.times[name] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(self._cpu() - c0, 1)}
        print(f"learning-check: {name} done in {self.times[name]['wall_s']}s (cpu {self.times[name]['cpu_s']}s)",
              flush=True)
        return out


# What each kept result is made by: a change to these sources makes it afresh (config.source_digest)
COHORT_CODE = ("ingest/synth.py",)
RECIPE_CODE = ("train", "evals", "octfm", "cache", "manifests")


def cohort(root: Path, participants: int) -> str:
    """The generated cohort, written once per generator config and generator code (a marker names both)."""
    cfg = dataclasses.replace(COHORT, participants=participants)
    marker = root / "cohort.json"
    want = json.dumps({**dataclasses.asdict(cfg), "code": config.source_digest(*COHORT_CODE)}, sort_keys=True)
    if not (marker.exists() and marker.read_text() == want):
        counts = synth.generate(root, cfg)
        print(f"learning-check: cohort of {participants} participants, {counts['good']} volumes in {root}")
        marker.write_text(want)
    else:
        print(f"learning-check: cohort in {root} reused")
    return str(root)


def build_cache(source: str, cache: Path) -> str:
    cfg = config.load(CacheConfig, "configs/cache.yaml", CACHE_ARGS)
    cache_build.build(source, str(cache), cfg, progress=True)
    return str(cache)


def recipe_name(config_path: str, cache: str, overrides: Sequence[str]) -> str:
    """A run name per recipe, cache and code, so a changed ARGS, SOURCE or trainer (train/, evals/
    and what they stand on) trains afresh and an unchanged one resumes."""
    blob = "\n".join([Path(config_path).read_text(), cache, *overrides, config.source_digest(*RECIPE_CODE)])
    return "pretrain_" + hashlib.sha256(blob.encode()).hexdigest()[:8]


def pretrain_run(config_path: str, cache: str, out: Path, overrides: Sequence[str]) -> Path:
    name = recipe_name(config_path, cache, overrides)
    args = ["--config", config_path, f"data.cache={cache}", f"runs_dir={out}", f"name={name}", *overrides]
    pretrain.main(args)  # raises on failure; resumes the run's newest checkpoint, or has nothing to do
    return out / name


def supervised_ckpt(config_path: str, cache: str, out: Path, overrides: Sequence[str]) -> str:
    """The supervised reference (evals/supervised.py): the recipe's encoder trained on the
    binary task's labels for as many steps as pretraining takes."""
    cfg = config.load(TrainConfig, config_path, [*overrides, f"data.cache={cache}"])
    name = recipe_name(config_path, cache, overrides).replace("pretrain_", "supervised_")
    return supervised.train(cfg, BINARY, str(out / name / "checkpoints"), cfg.max_steps)


def chosen_on_val(res: dict, encoder: str) -> str:
    """The head kind whose val score ranks first for an encoder (the test split never chooses)."""
    heads = [p for p in res["probes"] if p["encoder"] == encoder]
    return max(heads, key=lambda p: probe.val_rank(p["val_balanced_accuracy"], p["val_auroc"]))["head"]


def compare(task: str, res: dict, preds: dict, rows: list[dict], n_boot: int, seed: int) -> dict:
    """Test balanced accuracy of each encoder and the paired difference pretrained - random,
    for each head kind and for the head each encoder chose on val."""
    spec = TASKS[task]
    y = np.array([spec["map"](r["label"]) for r in rows])
    test = np.array([r["split"] == "test" for r in rows])
    groups = np.array([r["participant_id"] for r in rows])[test]
    k = spec["classes"]
    score = {(p["encoder"], p["head"]): p["test"]["balanced_accuracy"] for p in res["probes"]}
    val = {(p["encoder"], p["head"]): p.get("val_balanced_accuracy") for p in res["probes"]}
    ci = {(p["encoder"], p["head"]): p["test"]["balanced_accuracy_ci95"] for p in res["probes"]}
    heads = sorted({h for e, h in preds if e == "pretrained"})
    pairs = {h: (h, h) for h in heads}
    pairs["chosen_on_val"] = (chosen_on_val(res, "pretrained"), chosen_on_val(res, "random_init"))
    out = {"task": task, "classes": k, "test_rows": int(test.sum()), "test_participants": int(len(set(groups))),
           "majority_class": score[("none", "majority_class")], "comparisons": {}}
    for label, (hp, hr) in pairs.items():
        diff = pm.paired_difference_ci(y[test], preds[("pretrained", hp)][test], preds[("random_init", hr)][test],
                                       groups, k, n_boot, seed)
        out["comparisons"][label] = {"pretrained_head": hp, "random_head": hr,
                                     "pretrained": score[("pretrained", hp)], "pretrained_ci95": ci[("pretrained", hp)],
                                     "random_init": score[("random_init", hr)], "random_init_ci95": ci[("random_init", hr)],
                                     "val": {"pretrained": val[("pretrained", hp)], "random_init": val[("random_init", hr)]},
                                     **diff}
    return out


def reference_row(task: str, res: dict, preds: dict, rows: list[dict], n_boot: int, seed: int) -> dict:
    """The supervised reference against the random-init encoder, heads chosen on val."""
    c = compare(task, res, preds, rows, n_boot, seed)["comparisons"]["chosen_on_val"]
    return {"supervised": c["pretrained"], "supervised_ci95": c["pretrained_ci95"], "head": c["pretrained_head"],
            "random_init": c["random_init"], "difference": c["difference"], "difference_ci95": c["difference_ci95"]}


def online_curve(run_dir: Path) -> list[dict]:
    """The run's online-probe records (split `probe` in metrics.jsonl, keys `<task>/knn_bal_acc`
    and `<task>/ridge_bal_acc`, named `probe/<task>/...` here as in W&B), when it logged any."""
    probe = metrics.read_splits(run_dir).get("probe", {})
    return [{"step": step, **{f"probe/{k}": v for k, v in r.items() if k.endswith("_bal_acc")}}
            for step, r in sorted(probe.items())]


def training_summary(run_dir: Path) -> dict:
    train = [r for _, r in sorted(metrics.read_splits(run_dir).get("train", {}).items()) if "rankme" in r]
    if not train:
        return {}
    return {"steps": train[-1]["step"], "loss": [train[0]["loss"], train[-1]["loss"]],
            "rankme": [train[0]["rankme"], train[-1]["rankme"]]}


def verdict(result: dict) -> str:
    b = result["tasks"][BINARY]["comparisons"]["chosen_on_val"]
    m = result["tasks"][MULTI]["comparisons"]["chosen_on_val"]
    lo = b["difference_ci95"][0]
    ok = b["difference"] >= TARGET and lo is not None and lo > 0 and m["difference"] >= 0
    return (f"learning-check: {'PASS' if ok else 'FAIL'}: pretrained - random-init balanced accuracy (test, heads "
            f"chosen on val): {BINARY} {b['difference']:+.3f} [{_f(lo)}, {_f(b['difference_ci95'][1])}] "
            f"({b['pretrained']:.3f} vs {b['random_init']:.3f}), {MULTI} {m['difference']:+.3f} "
            f"[{_f(m['difference_ci95'][0])}, {_f(m['difference_ci95'][1])}] ({m['pretrained']:.3f} vs "
            f"{m['random_init']:.3f}); target {BINARY} >= +{TARGET:.2f} with the interval above 0, {MULTI} >= 0")


def _f(v) -> str:
    return "n/a" if v is None else f"{v:+.3f}"


def markdown(result: dict) -> str:
    lines = ["# Learning check", "", result["verdict"], "",
             f"Source `{result['source']}`, cache `{result['cache']}`, run `{result['run']}` (step {result['step']}; "
             f"objective: {result.get('objective', 'not recorded')}). "
             f"Intervals: 95% bootstrap over test participants ({result['bootstrap']} resamples); the difference "
             "is paired (both encoders scored on each resample).", ""]
    for task, t in result["tasks"].items():
        lines += [f"## {task} ({t['classes']} classes; test: {t['test_rows']} volumes, {t['test_participants']} "
                  f"participants; majority class {t['majority_class']:.3f})", "",
                  "| heads | val: pretrained / random | test: pretrained | test: random-init | "
                  "test: pretrained - random [95% CI] |", "|---|---|---|---|---|"]
        for label, c in t["comparisons"].items():
            heads = c["pretrained_head"] if c["pretrained_head"] == c["random_head"] else \
                f"{c['pretrained_head']} / {c['random_head']}"
            lines.append(f"| {label} ({heads}) | {_num(c['val']['pretrained'])} / {_num(c['val']['random_init'])} | "
                         f"{c['pretrained']:.3f} | {c['random_init']:.3f} | "
                         f"{c['difference']:+.3f} [{_f(c['difference_ci95'][0])}, {_f(c['difference_ci95'][1])}] |")
        lines.append("")
    ref = result.get("supervised_reference")
    if ref:
        lines += ["Supervised reference: the same encoder trained on the diabetic labels of the train split for as "
                  "many steps (it sees labels that pretraining never does), probed like the pretrained one. It "
                  "measures how far label-aware features of this architecture get on this cohort.", "",
                  "| task | supervised (head) | random-init | supervised - random [95% CI] |", "|---|---|---|---|"]
        lines += [f"| {t} | {r['supervised']:.3f} ({r['head']}) | {r['random_init']:.3f} | {r['difference']:+.3f} "
                  f"[{_f(r['difference_ci95'][0])}, {_f(r['difference_ci95'][1])}] |" for t, r in ref.items()]
        lines.append("")
    tr = result["training"]
    if tr:
        lines += [f"Pretraining: {tr['steps']} steps, loss {tr['loss'][0]:.4f} -> {tr['loss'][1]:.4f}, "
                  f"RankMe {tr['rankme'][0]:.1f} -> {tr['rankme'][1]:.1f}.", ""]
    curve = result["online_probe"]
    if curve:
        keys = sorted({k for r in curve for k in r if k != "step"})
        lines += ["Online probe (logged during pretraining):", "", "| step | " + " | ".join(keys) + " |",
                  "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {r['step']} | " + " | ".join(_num(r.get(k)) for k in keys) + " |" for r in curve]
    else:
        lines.append("Online probe: the run logged none (`probe/<task>/knn_bal_acc` in metrics.jsonl).")
    lines += ["", "| stage | wall s | cpu s |", "|---|---|---|"]
    lines += [f"| {k} | {v['wall_s']} | {v['cpu_s']} |" for k, v in result["stages"].items()]
    return "\n".join(lines) + "\n"


def _num(v) -> str:
    return "" if v is None else f"{v:.3f}"


def plot(result: dict, path: Path) -> None:
    """Test balanced accuracy per encoder (heads chosen on val) with intervals, and the online probe."""
    plt = plots.pyplot()
    curve = result["online_probe"]
    fig, axes = plt.subplots(1, 2 if curve else 1, figsize=(10 if curve else 5.5, 4), squeeze=False)
    ax = axes[0][0]
    for i, (task, t) in enumerate(result["tasks"].items()):
        c = t["comparisons"]["chosen_on_val"]
        for j, (name, v, ci) in enumerate((("pretrained", c["pretrained"], c["pretrained_ci95"]),
                                           ("random-init", c["random_init"], c["random_init_ci95"]),
                                           ("majority", t["majority_class"], None))):
            err = None if not ci or ci[0] is None else [[v - ci[0]], [ci[1] - v]]
            ax.bar(i * 4 + j, v, yerr=err, color=f"C{j}", label=name if i == 0 else None, capsize=3)
    ax.set_xticks([1, 5], list(result["tasks"]))
    ax.set_ylabel("test balanced accuracy")
    ax.legend(fontsize=8)
    ax.set_title("heads chosen on val, 95% participant bootstrap", fontsize=9)
    if curve:
        ax = axes[0][1]
        for k in sorted({k for r in curve for k in r if k != "step"}):
            pts = [(r["step"], r[k]) for r in curve if r.get(k) is not None]
            ax.plot(*zip(*pts), marker="o", label=k)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.set_title("online probe", fontsize=9)
    fig.tight_layout()
    fsio.atomic_write_bytes(str(path), plots.to_png(fig, dpi=90))
    plt.close(fig)


def check(source: str | None, work: Path, out: Path, config_path: str, overrides: Sequence[str],
          participants: int = COHORT.participants, n_boot: int = 1000, probe_args: Sequence[str] = (),
          with_supervised: bool = True) -> dict:
    """The whole check; every stage reuses what an earlier run finished."""
    stages = Stages()
    config.load(TrainConfig, config_path, overrides)  # refuse bad ARGS before any work
    if source is None:
        source = stages.run("cohort", lambda: cohort(work / "source", participants))
        cache_dir = work / "cache"
    else:
        cache_dir = work / ("cache_" + hashlib.sha256(source.encode()).hexdigest()[:8])
    cache = stages.run("cache", lambda: build_cache(source, cache_dir))
    run_dir = stages.run("pretrain", lambda: pretrain_run(config_path, cache, out, overrides))
    ckpt = checkpoint.newest_whole(RunFolder(run_dir).checkpoints())
    pcfg = config.load(ProbeConfig, "configs/probe.yaml",
                       [f"cache={cache}", f"bootstrap={n_boot}", "per_device=false", "cross_device=false",
                        "baselines=true", *probe_args])
    preds: dict = {}
    res = stages.run("probe", lambda: probe.probe_checkpoint(pcfg, ckpt, RunFolder(run_dir).probe, predictions=preds))
    reference = {}
    if with_supervised:
        sup_preds: dict = {}
        # probed in the run's probe folder: the random-init features are reused; no reports are written
        sup_res = stages.run("supervised reference", lambda: probe.probe_checkpoint(
            pcfg, supervised_ckpt(config_path, cache, out, overrides), RunFolder(run_dir).probe, reports=False,
            predictions=sup_preds))
        reference = {t: reference_row(t, sup_res["results"][t], sup_preds[t], sup_preds["rows"], n_boot, pcfg.seed)
                     for t in (MULTI, BINARY)}
    result = {"source": source, "cache": cache, "run": str(run_dir), "ckpt": ckpt, "step": res["step"],
              "objective": objective(config.load(TrainConfig, config_path, overrides).loss),
              "overrides": list(overrides), "bootstrap": n_boot, "target": TARGET,
              "features_reused": res["features_reused"],
              "tasks": {t: compare(t, res["results"][t], preds[t], preds["rows"], n_boot, pcfg.seed)
                        for t in (MULTI, BINARY)},
              "supervised_reference": reference,
              "training": training_summary(run_dir), "online_probe": online_curve(run_dir), "stages": stages.times}
    result["verdict"] = verdict(result)
    out.mkdir(parents=True, exist_ok=True)
    fsio.atomic_write_bytes(str(out / "result.json"), json.dumps(result, indent=2, default=float).encode())
    fsio.atomic_write_bytes(str(out / "result.md"), markdown(result).encode())
    plot(result, out / "result.png")
    return result


def probe_line(probe_dir: Path) -> str:
    """One line from a run's probe reports: pretrained vs random-init test balanced accuracy
    with intervals, each encoder with its head chosen on val (the demo ends with it)."""
    parts = []
    for task in (BINARY, MULTI):
        path = probe_dir / task / "metrics.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())
        enc = {}
        for name in ("pretrained", "random_init"):
            head = chosen_on_val(res, name)
            t = next(p for p in res["probes"] if p["encoder"] == name and p["head"] == head)["test"]
            lo, hi = t["balanced_accuracy_ci95"]
            enc[name] = f"{t['balanced_accuracy']:.2f} [{lo:.2f}, {hi:.2f}]"
        parts.append(f"{task} {enc['pretrained']} vs {enc['random_init']}")
    if not parts:
        raise cli.UsageError(f"{probe_dir}: no probe reports (run `make probe` first)")
    return ("pretrained vs random-init encoder, test balanced accuracy [95% CI over participants], heads chosen "
            "on val: " + "; ".join(parts))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make learning-check", description=__doc__)
    ap.add_argument("--source", default=None, help="AI-READI-shaped dataset root with labels (default: the cohort)")
    ap.add_argument("--work", default="data/learning_check", help="where the cohort and its cache go")
    ap.add_argument("--out", default="runs/learning_check")
    ap.add_argument("--config", default="configs/pretrain_check.yaml")
    ap.add_argument("--participants", type=int, default=COHORT.participants, help="cohort size")
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--probe", action="append", default=[], help="a probe config override (key=value)")
    ap.add_argument("--no-supervised", action="store_true",
                    help="skip the supervised reference (the same encoder trained on the labels)")
    ap.add_argument("--line", metavar="RUN", default=None,
                    help="only print the one-line comparison from RUN/probe (no work)")
    ap.add_argument("overrides", nargs="*", help="pretraining config overrides (make ARGS)")
    a = ap.parse_args(argv)
    if a.line:
        print(probe_line(RunFolder(a.line).probe))
        return 0
    t0 = time.perf_counter()
    r = check(a.source, Path(a.work), Path(a.out), a.config, a.overrides, a.participants, a.bootstrap, a.probe,
              with_supervised=not a.no_supervised)
    print(markdown(r))
    print(f"learning-check: wrote {a.out}/result.json, result.md, result.png in {time.perf_counter() - t0:.0f}s")
    print(r["verdict"])
    return 0


if __name__ == "__main__":
    cli.run(main)
