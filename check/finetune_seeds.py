"""`python -m check.finetune_seeds run|score`: fine-tuning rows over several seeds, paired afterwards.

A single fine-tuning run moves by a few points of balanced accuracy from one seed to the next, so
a difference read from one run per init is mostly noise (issue 41, item 4).

- `run`: `make finetune` (configs/finetune.yaml as users run it) from a checkpoint and from random
  init at one label fraction, once per seed. Each run's class probabilities for every row are kept
  (`<init>_s<seed>.npz`). A killed batch resumes run by run, and each run from its last epoch.
  A seed sets the labelled subset and the training's randomness alike (FinetuneConfig.seed), unless
  a `train_seed=` override fixes the training's.
- `score`: folders of such runs (two code versions, or two recipes, on the same cache) read back
  and paired on the same test participants: per seed, the mean over seeds (each bootstrap resample
  averages the seeds' differences), and the second folder minus the first.

docs/history/learning-check.md (what issue 40's fine-tuning fixes do to the fine-tuning rows) is the
measurement this was written for.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from check import probes as check_probes
from evals import probe
from evals import probe_metrics as pm
from manifests.aireadi import TASKS
from octfm import cli

INITS = ("pretrained", "random")


def run_name(init: str, seed: int) -> str:
    return f"{init}_s{seed}"


def run_seeds(ckpt: str, cache: str, out: Path, fraction: float, seeds: Sequence[int], task: str = "diabetic",
              args: Sequence[str] = (), device: str = "cpu", inits: Sequence[str] = INITS) -> list[Path]:
    """Fine-tune from the checkpoint and from random init for each seed; returns the npz files.
    `inits`: one of them alone, so that two processes can run a pair side by side on one folder."""
    if not inits or set(inits) - set(INITS):
        raise cli.UsageError(f"--inits {' '.join(inits)}: each one of {', '.join(INITS)}")
    from evals import finetune  # the training stack only where runs are made (score needs none of it)
    from train import runtime

    done = []
    for seed in seeds:
        for init in inits:
            path = out / f"{run_name(init, seed)}.npz"
            if not path.exists():
                cfg = finetune.run_config(ckpt, cache, out / run_name(init, seed), init, fraction, seed, task, device, *args)
                t0 = time.perf_counter()
                ft = finetune.Finetuner(cfg, runtime.setup(cfg.device, cfg.precision))
                res = ft.run(progress=True)
                best = res["probes"][0]
                out.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.name + ".tmp")  # not *.npz: a half-written file is never read as a run
                with open(tmp, "wb") as fh:
                    np.savez(fh, prob=res["prob"], relpath=np.array([r["relpath"] for r in ft.rows]),
                             val=best["val_balanced_accuracy"], best_epoch=best["best_epoch"], epochs=res["epochs_run"],
                             seconds=time.perf_counter() - t0)
                tmp.replace(path)
                print(f"finetune_seeds: {path} (val {best['val_balanced_accuracy']:.3f}, "
                      f"test {best['test']['balanced_accuracy']:.3f}, {time.perf_counter() - t0:.0f}s)", flush=True)
            done.append(path)
    return done


def load_runs(folder: Path, relpaths: list[str]) -> dict:
    """{(init, seed): npz contents} of a run folder, checked to cover exactly these rows in this order."""
    runs = {}
    for path in sorted(folder.glob("*_s*.npz")):
        init, seed = path.stem.rsplit("_s", 1)
        with np.load(path) as z:
            if list(z["relpath"]) != relpaths:
                raise cli.UsageError(f"{path}: its rows are not the cache's labelled rows (another cache?)")
            runs[(init, int(seed))] = {k: z[k] for k in z.files}
    if not runs:
        raise cli.UsageError(f"{folder}: no fine-tuning runs (<init>_s<seed>.npz) in it")
    return runs


def seeds_of(runs: dict) -> list[int]:
    """The seeds with a run from both inits."""
    return sorted({s for i, s in runs if i == INITS[0]} & {s for i, s in runs if i == INITS[1]})


def score_folders(cache: str, folders: dict[str, Path], task: str = "diabetic", n_boot: int = 1000,
                  seed: int = 0) -> dict:
    """Per folder: each seed's test scores and pretrained minus random init, and the mean over seeds;
    with two folders, the second minus the first per init and for the difference (their common seeds)."""
    rows = probe.labelled_rows(cache, 0, shuffle=False)
    spec = TASKS[task]
    y = np.array([spec["map"](r["label"]) for r in rows])
    groups = np.array([r["participant_id"] for r in rows])
    te = np.array([r["split"] == "test" for r in rows])
    k = spec["classes"]
    loaded = {name: load_runs(Path(f), [r["relpath"] for r in rows]) for name, f in folders.items()}

    def contrast(terms):
        return pm.contrast_ci(y[te], [(w, p[te]) for w, p in terms], groups[te], k, n_boot, seed)

    out = {"task": task, "cache": cache, "test_participants": int(len(set(groups[te]))), "folders": {}}
    for name, runs in loaded.items():
        seeds = seeds_of(runs)
        if not seeds:
            raise cli.UsageError(f"{folders[name]}: no seed with a run from both inits ({', '.join(INITS)})")
        per_seed = []
        for s in seeds:
            p, r = runs[(INITS[0], s)], runs[(INITS[1], s)]
            per_seed.append({"seed": s, **{init: {"val": float(runs[(init, s)]["val"]),
                                                  "test": pm.balanced_accuracy(y[te], runs[(init, s)]["prob"][te].argmax(1), k),
                                                  "best_epoch": int(runs[(init, s)]["best_epoch"]),
                                                  "epochs": int(runs[(init, s)]["epochs"]),
                                                  "seconds": float(runs[(init, s)]["seconds"])} for init in INITS},
                             "difference": contrast([(1.0, p["prob"]), (-1.0, r["prob"])])})
        n = len(seeds)
        mean = {init: contrast([(1.0 / n, runs[(init, s)]["prob"]) for s in seeds]) for init in INITS}
        mean["difference"] = contrast([(sign / n, runs[(init, s)]["prob"]) for s in seeds
                                       for init, sign in zip(INITS, (1.0, -1.0))])
        if n > 1:  # the same mean, its interval drawing the seeds as well as the participants
            mean["difference_seeds_resampled"] = check_probes.seed_resampled_paired(
                task, rows, *([runs[(init, s)]["prob"] for s in seeds] for init in INITS), te, n_boot, seed)
        out["folders"][name] = {"folder": str(folders[name]), "seeds": seeds, "per_seed": per_seed, "mean": mean}
    if len(loaded) == 2:
        (a, ra), (b, rb) = loaded.items()
        common = sorted(set(seeds_of(ra)) & set(seeds_of(rb)))
        if not common:
            raise cli.UsageError(f"{folders[a]} and {folders[b]}: no seed in common to pair")
        n = len(common)
        change = {init: contrast([(w / n, runs[(init, s)]["prob"]) for s in common for w, runs in ((1.0, rb), (-1.0, ra))])
                  for init in INITS}
        change["difference"] = contrast([(w * sign / n, runs[(init, s)]["prob"]) for s in common
                                         for w, runs in ((1.0, rb), (-1.0, ra)) for init, sign in zip(INITS, (1.0, -1.0))])
        out["change"] = {"from": a, "to": b, "seeds": common, **change}
    return out


def _d(c: dict) -> str:
    lo, hi = c["difference_ci95"]
    return f"{c['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}]" if lo is not None else f"{c['difference']:+.3f}"


def report(res: dict) -> str:
    """Markdown: a table per folder and the change between two."""
    lines = [f"# Fine-tuning over seeds: {res['task']} (test: {res['test_participants']} participants)", ""]
    for name, f in res["folders"].items():
        lines += [f"## {name} (`{f['folder']}`)", "",
                  "| seed | val: pretrained / random | test: pretrained | test: random | pretrained - random [95% CI] "
                  "| best epoch (of run): pretrained / random |", "|---|---|---|---|---|---|"]
        for r in f["per_seed"]:
            p, q = r[INITS[0]], r[INITS[1]]
            lines.append(f"| {r['seed']} | {p['val']:.3f} / {q['val']:.3f} | {p['test']:.3f} | {q['test']:.3f} | "
                         f"{_d(r['difference'])} | {p['best_epoch']} ({p['epochs']}) / {q['best_epoch']} ({q['epochs']}) |")
        m = f["mean"]
        lines += [f"| mean | | {m[INITS[0]]['difference']:.3f} | {m[INITS[1]]['difference']:.3f} | "
                  f"{_d(m['difference'])} | |", ""]
        if "difference_seeds_resampled" in m:
            lines += [f"Mean difference with the seeds resampled as well as the participants: "
                      f"{_d(m['difference_seeds_resampled'])}.", ""]
    if "change" in res:
        c = res["change"]
        lines += [f"## {c['to']} minus {c['from']} (mean over seeds {c['seeds']})", "",
                  "| row | change [95% CI] |", "|---|---|",
                  *(f"| {name} | {_d(c[name])} |" for name in (*INITS, "difference")), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m check.finetune_seeds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="fine-tune from the checkpoint and from random init, once per seed")
    r.add_argument("--ckpt", required=True)
    r.add_argument("--cache", required=True)
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--fraction", type=float, default=0.1)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="seeds that pick the participants and, unless train_seed= is given, the training's randomness "
                        "(default 0 1 2); overrides after it follow `--`")
    r.add_argument("--task", default="diabetic")
    r.add_argument("--device", default="cpu")
    r.add_argument("--inits", nargs="+", default=list(INITS),
                   help="pretrained, random or both (the default); overrides after it follow `--`")
    r.add_argument("overrides", nargs="*", help="configs/finetune.yaml keys, key=value")
    s = sub.add_parser("score", help="pair the runs of one or two folders on the test participants")
    s.add_argument("--cache", required=True)
    s.add_argument("--task", default="diabetic")
    s.add_argument("--out", type=Path, default=None, help="writes <out>.json and <out>.md")
    s.add_argument("folders", nargs="+", help="NAME=FOLDER (one, or two: the change is the second minus the first)")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        run_seeds(a.ckpt, a.cache, a.out, a.fraction, a.seeds, a.task, a.overrides, a.device, a.inits)
        return 0
    if len(a.folders) > 2 or any("=" not in f for f in a.folders):
        raise cli.UsageError("folders: give one or two NAME=FOLDER")
    res = score_folders(a.cache, dict(f.split("=", 1) for f in a.folders), a.task)
    text = report(res)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(res, indent=2))
        a.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    cli.run(main)
