"""result.json's rows: from the learning check's encoders' features and fine-tuned probabilities, the
headline, the label-efficiency curve, the supervised references, the held-out scanners and fine-tuning,
each a paired comparison on the same test participants; and the pretraining's summary and online-probe curve."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from check import probes as check_probes
from check.cohort import BINARY, MULTI
from check.verdicts import SEEDS_RESAMPLED, pct
from evals import features, probe, subsets
from evals.config import ProbeConfig
from octfm.procs import call_job, in_processes
from train import checkpoint, metrics


# what the label-efficiency rows select on: said in result.json
SELECTION = ("at every label fraction the probes' grid, the head kind and early stopping select on the full val "
             "split (val labels beyond the fraction); no row selects on a val subset of the same fraction")

def finetune_rows(rows: list[dict], tuned: dict, frozen: dict, fs: list, n_boot: int, seed: int,
                  supervised: dict | None = None) -> list[dict]:
    """Per fraction: fine-tuned from the checkpoint and from random init (test balanced accuracy,
    the paired difference), fine-tuned against the frozen probe (the head val chose) of the same encoder on
    the same participants and, where a supervised reference was trained on them (`supervised`:
    {fraction: its chosen head's probabilities}), against it: label efficiency with fine-tuning.
    `tuned`: {fraction: {init: [probabilities per training seed]}}; a fine-tuned row is the mean
    over its seeds, every seed scored on each participant resample."""
    out, te, supervised = [], check_probes.tested_rows(fs), supervised or {}
    for f in sorted(tuned):
        p = tuned[f]["pretrained"]
        against = {"random_init": ("pretrained_minus_random_init", tuned[f]["random"]),   # name: (difference key, runs)
                   "frozen": ("finetuned_minus_frozen", [frozen[f]])}
        if f in supervised:
            against["supervised"] = ("finetuned_minus_supervised", [supervised[f]])
        row = {"fraction": f, "train_seeds": len(p), "pretrained": check_probes.mean_score(BINARY, rows, p, te, n_boot, seed),
               "per_seed": {init: [check_probes.score(BINARY, rows, q, te, 0, seed)["balanced_accuracy"] for q in runs]
                            for init, runs in (("pretrained", p), ("random_init", tuned[f]["random"]))}}
        for name, (key, q) in against.items():
            row[name] = check_probes.mean_score(BINARY, rows, q, te, n_boot, seed)
            row[key] = check_probes.mean_paired(BINARY, rows, p, q, te, n_boot, seed)
        if len(p) > 1:  # a reading beside the verdict's interval: another draw of training seeds moves the mean too
            row[SEEDS_RESAMPLED] = check_probes.seed_resampled_paired(
                BINARY, rows, p, tuned[f]["random"], te, n_boot, seed)
        out.append(row)
    return out


def reference_row(task: str, rows: list[dict], sup: dict, rand: dict, fs: list, n_boot: int, seed: int) -> dict:
    """The supervised reference (all labels) against the random-init encoder (the mean of its draws),
    heads chosen on val."""
    te = check_probes.tested_rows(fs)
    s, r = (check_probes.mean_score(task, rows, check_probes.probs(f), te, n_boot, seed) for f in (sup, rand))
    d = check_probes.mean_paired(task, rows, check_probes.probs(sup), check_probes.probs(rand), te, n_boot, seed)
    return {"supervised": s["balanced_accuracy"], "supervised_ci95": s["ci95"], "random_init": r["balanced_accuracy"],
            "head": check_probes._heads(sup[check_probes.CHOSEN]), **d}


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


def reference_training(run: dict) -> dict:
    """How a reference (its from-scratch fine-tuning run, Tuned.run) trained, for result.json."""
    keys = ("best_epoch", "best_step", "epochs_run", "steps_run", "val_every", "patience", "head")
    return {k: run[k] for k in keys if k in run} | {"best_val_balanced_accuracy": max(run["val"], default=None)}


def supervised_features(pcfg: ProbeConfig, ckpts: dict, probe_dir: Path) -> dict:
    """{fraction: features} of the references' best checkpoints ({fraction: ckpt}), their encoders
    read in one pass over the cache (no random-init baseline: the check has it)."""
    encoders, tcfg = {}, None
    for frac, ckpt in ckpts.items():
        path, st = checkpoint.load_named(ckpt)
        enc, tcfg, ident = features.checkpoint_encoder(path, state=st)
        encoders[pct(frac)] = (enc, ident)
    feats = probe.encoder_features(dataclasses.replace(pcfg, baselines=False), encoders, tcfg, probe_dir)["feats"]
    return {frac: feats[pct(frac)] for frac in ckpts}


def frozen_probe(fitted: dict) -> np.ndarray:
    """The frozen probe a fine-tuned encoder is set against: its encoder's head chosen on val (the
    check's rule), not a fixed kind."""
    return fitted[check_probes.CHOSEN]["prob"]


def headline_probes(pcfg: ProbeConfig, rows: list[dict], feats: dict, protocol: str, n_boot: int,
                    together: int | None = None) -> dict:
    """The check's headline: both encoders' heads for the two tasks on all labels (`fits`, over
    the protocol's `folds`) and pretrained against random init with heads chosen on val (`tasks`;
    the verdict reads the one kind chosen for the pair, check_probes.pair_choice).
    Done once, right after the features (the interim result); probe_all builds on it. Random init is
    each of its draws; a task's fits of every encoder train as one stack of heads
    (check_probes.fit_encoders). `together` (not None): the two tasks each in its own process at
    once, on that many torch threads each, 0 for torch's default (the GPU size: a head's step of
    batch 32 leaves the GPU mostly idle; the CPU size: two single-thread processes use the cores
    better; the same fits)."""
    fs, encs = check_probes.folds(rows, protocol), ["pretrained", *probe.random_draws(feats)]
    jobs = {t: (check_probes.fit_encoders, (pcfg, [feats[e] for e in encs], t, rows, fs, None, True))
            for t in (MULTI, BINARY)}
    done = in_processes(jobs, len(jobs), threads=together) if together is not None else \
        {t: call_job(job) for t, job in jobs.items()}
    fits = {t: {"pretrained": done[t][0], "random_init": done[t][1:]} for t in (MULTI, BINARY)}
    return {"folds": fs, "fits": fits,
            "tasks": {t: check_probes.compare(t, rows, fits[t], fs, n_boot, pcfg.seed) for t in (MULTI, BINARY)}}


def curve_fits(pcfg: ProbeConfig, rows: list[dict], feats: dict, fs: list, fractions) -> dict:
    """{(fraction, encoder): fit_encoder's result}: the pretrained encoder's and each random-init draw's
    binary heads at each curve fraction below all labels, each fold's heads for its full split's steps
    (docs/recipe.md, Probes). They need no reference, so at GPU size they train in their own process beside
    the references (Stages.together) rather than after them in the probes stage. A fraction's
    encoders train as one stack of heads (check_probes.fit_encoders)."""
    people, encs = subsets.nested_fractions(rows, fractions, pcfg.seed), ["pretrained", *probe.random_draws(feats)]
    out = {}
    for f in sorted(people):
        if f < 1.0:
            fits = check_probes.fit_encoders(pcfg, [feats[e] for e in encs], BINARY, rows,
                                             check_probes.narrowed(fs, rows, people[f]), fs)
            out.update({(f, e): fit for e, fit in zip(encs, fits)})
    return out


def probe_all(pcfg: ProbeConfig, rows: list[dict], feats: dict, sup: dict, protocol: str, fractions, n_boot: int,
              tuned: dict | None = None, head: dict | None = None, curve: dict | None = None) -> dict:
    """Heads on every encoder's features: the two tasks on all labels (`head`: headline_probes'
    result, when done already), the binary task's label-efficiency curve (`curve`: curve_fits'
    result, when done already), for the scanners protocol each held-out scanner and, given
    fine-tuned probabilities ({fraction: {init: prob}}), the fine-tuning rows."""
    seed, tuned = pcfg.seed, tuned or {}
    head = head or headline_probes(pcfg, rows, feats, protocol, n_boot)
    fs, fits = head["folds"], head["fits"]
    curve_fit = curve if curve is not None else curve_fits(pcfg, rows, feats, fs, fractions)
    out = {"tasks": head["tasks"]}
    sup_all = {t: check_probes.fit_encoder(pcfg, sup[1.0], t, rows, fs) for t in (MULTI, BINARY)} if 1.0 in sup else {}
    if sup_all:
        out["supervised_reference"] = {t: reference_row(t, rows, sup_all[t], fits[t]["random_init"], fs, n_boot, seed)
                                       for t in (MULTI, BINARY)}
    if protocol == "scanners":
        out["per_scanner"] = check_probes.per_scanner(BINARY, rows, fits[BINARY], fs, n_boot, seed)
    people = subsets.nested_fractions(rows, {*fractions, *tuned}, seed)
    curve, frozen, sup_chosen = [], {}, {}
    for f in sorted(people):
        # below all labels each fold's heads train its full split's steps, not `epochs` of fewer rows
        ff, full = check_probes.narrowed(fs, rows, people[f]), None if f == 1.0 else fs
        if f not in fractions:  # a fine-tuning fraction off the curve: only the frozen probe it is set against
            frozen[f] = frozen_probe(check_probes.fit_encoder(pcfg, feats["pretrained"], BINARY, rows, ff, full))
            continue
        encs = {"pretrained": fits[BINARY]["pretrained"] if f == 1.0 else curve_fit[(f, "pretrained")],
                "random_init": fits[BINARY]["random_init"] if f == 1.0 else
                [curve_fit[(f, e)] for e in probe.random_draws(feats)]}
        if f in sup:  # all labels: the reference row's fit where the folds are the same (one fit, not two)
            same = f == 1.0 and all(np.array_equal(a[1], b[1]) for a, b in zip(ff, fs))
            encs["supervised"] = sup_all[BINARY] if same else check_probes.fit_encoder(pcfg, sup[f], BINARY, rows, ff, full)
        if f in tuned:
            frozen[f] = frozen_probe(encs["pretrained"])
            if "supervised" in encs:
                sup_chosen[f] = encs["supervised"][check_probes.CHOSEN]["prob"]
        curve.append({"fraction": f, "participants": len(people[f]),
                      **check_probes.curve_point(BINARY, rows, encs, ff, n_boot, seed)})
    out["label_efficiency"] = {"task": BINARY, "points": curve, "selection": SELECTION}
    if any(f < 1.0 for f in people):  # the steps each fold's heads train below all labels
        out["label_efficiency"]["head_steps"] = [probe.fraction_steps(pcfg, tr) for _, tr, _, _ in fs]
    if tuned:
        out["finetune"] = {"task": BINARY, "points": finetune_rows(rows, tuned, frozen, fs, n_boot, seed, sup_chosen)}
    return out
