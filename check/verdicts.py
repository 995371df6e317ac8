"""The learning check's verdict lines, one per question, each against its target: does pretraining learn
(the headline), label efficiency, fine-tuning (docs/recipe.md, The learning check)."""
from __future__ import annotations

import numpy as np

from check import probes as check_probes
from check.cohort import BINARY, MULTI
from check.run_names import percent
from evals import probe


FINETUNE_TARGET = 0.05  # fine-tuned pretrained minus random-init at the smallest fraction
# a fine-tuning row's mean difference with the training seeds resampled too: a reading, not the verdict's
SEEDS_RESAMPLED = "pretrained_minus_random_init_seeds_resampled"


def finetune_against_supervised(points: list[dict]) -> str | None:
    """At the smallest fraction with a supervised reference: fine-tuned from the checkpoint
    against the reference trained on the same labels (an extra row beside the label-efficiency
    target, which reads a frozen probe)."""
    for p in points:
        if "finetuned_minus_supervised" in p:
            return (f"fine-tuned at {pct(p['fraction'])} of labels vs the supervised reference trained on them: "
                    f"{p['pretrained']['balanced_accuracy']:.3f} vs {p['supervised']['balanced_accuracy']:.3f}, "
                    f"{_diff(p['finetuned_minus_supervised'])}")
    return None


def finetune_verdict(points: list[dict]) -> str:
    """The fine-tuning target at the smallest fraction: fine-tuned pretrained minus random-init >= +0.05
    with the paired lower bound above 0, and fine-tuned >= the frozen probe with the head val chose;
    then, as readings without a target, the same pair at each larger fraction (at 10% and
    at 100% of labels). Both starts are `make finetune` under one recipe (the random start is the
    supervised reference)."""
    first = points[0]
    d, lo = first["pretrained_minus_random_init"]["difference"], first["pretrained_minus_random_init"]["difference_ci95"][0]
    ok = d >= FINETUNE_TARGET and lo is not None and lo > 0 and \
        first["pretrained"]["balanced_accuracy"] >= first["frozen"]["balanced_accuracy"]
    head = (f"fine-tuning, from the checkpoint against from scratch and against the frozen probe: "
            f"{'PASS' if ok else 'FAIL'} (target at {pct(first['fraction'])} of labels: pretrained - random-init >= "
            f"+{FINETUNE_TARGET:.2f} with the interval above 0, and fine-tuned >= frozen)")
    return "\n".join([head, *(finetune_point_line(p) for p in points)])


def finetune_point_line(p: dict) -> str:
    """One fraction's fine-tuning reading: the two starts and the frozen probe, with paired intervals."""
    seeds = ""
    if p.get("train_seeds", 1) > 1:  # the interval resamples participants for these seeds: say how the seeds spread
        per = np.subtract(p["per_seed"]["pretrained"], p["per_seed"]["random_init"])
        seeds = (f", mean of {p['train_seeds']} training seeds (per seed {', '.join(f'{d:+.3f}' for d in per)}; "
                 f"{int((per > 0).sum())} of {len(per)} above 0" + (
                     f"; mean with the seeds resampled too {_diff(p[SEEDS_RESAMPLED])}"
                     if SEEDS_RESAMPLED in p else "") + ")")
    ft = p["pretrained"]["balanced_accuracy"]
    return (f"- {pct(p['fraction'])} of labels{seeds}: fine-tuned {ft:.3f}, from scratch "
            f"{p['random_init']['balanced_accuracy']:.3f}, frozen probe (head chosen on val) "
            f"{p['frozen']['balanced_accuracy']:.3f}; pretrained - random-init {_diff(p['pretrained_minus_random_init'])}, "
            f"fine-tuned - frozen {_diff(p['finetuned_minus_frozen'])}")


def chosen_on_val(res: dict, encoder: str) -> str:
    """The head kind whose val score ranks first for an encoder (the test split never chooses)."""
    heads = [p for p in res["probes"] if p["encoder"] == encoder]
    return max(heads, key=lambda p: probe.val_rank(p["val_balanced_accuracy"], p["val_auroc"]))["head"]


def label_efficiency_verdict(result: dict) -> str | None:
    """Label efficiency, its own question: at the curve's smallest fraction, the frozen pretrained probe
    against the supervised reference trained on the same participants (target: pretrained >= supervised).
    None where no reference was trained (the default, the scanners cue, the interim result)."""
    points = (result.get("label_efficiency") or {}).get("points", [])
    if not any("supervised" in p for p in points):
        return None
    first, head = points[0], f"label efficiency [{result['cue']}]: "
    if "supervised" not in first:  # a reference at larger fractions only: said, not dropped
        return head + f"NOT READ: no supervised reference at {pct(first['fraction'])} of labels"
    p, s = first["pretrained"]["balanced_accuracy"], first["supervised"]["balanced_accuracy"]
    return head + (f"{'PASS' if p >= s else 'FAIL'}: at {pct(first['fraction'])} of labels frozen pretrained {p:.3f} "
                   f"vs supervised {s:.3f} (target: pretrained >= supervised)")


def verdict_lines(result: dict) -> list[str]:
    """Every question's verdict, as the check ends by printing them: does pretraining learn, label
    efficiency (where a reference was trained), fine-tuning (where run: against the supervised reference,
    then its target line and a reading per fraction). On the cohort's own splits a question not asked says
    how to ask it."""
    tuned, cue = result.get("finetune") or {}, result["cue"]
    efficiency = (result.get("label_efficiency") or {}).get("verdict")
    if result.get("protocol") == "splits":
        efficiency = efficiency or (f"label efficiency [{cue}]: NOT ASKED: LABELS=1 (--label-efficiency) trains the "
                                    f"supervised reference at 10% of labels (about 25 more minutes on 2 cores)")
        tuned = tuned or {"verdict": f"fine-tuning [{cue}]: NOT ASKED: FINETUNE=1 (--finetune) fine-tunes the "
                                     f"checkpoint and a random-init encoder"}
    return [result["verdict"], *(line for line in (efficiency, tuned.get("against_supervised"), tuned.get("verdict"))
                                 if line)]


def headline_row(task: dict) -> dict:
    """The comparison a task's verdict reads: both encoders through the one head kind chosen on their
    mean val (check_probes.pair_choice; each encoder's own choice, one_se_choice, stays beside it as CHOSEN)."""
    return task["comparisons"][check_probes.SAME_KIND]


def verdict(result: dict) -> str:
    """Does pretraining learn (the headline): pretrained minus random init on the binary task at the cue's
    target with the paired interval above 0 (and, on the cohort's own splits, not below 0 on the other task)."""
    b, m = headline_row(result["tasks"][BINARY]), headline_row(result["tasks"][MULTI])
    lo, target = b["difference_ci95"][0], result["target"]
    ok = b["difference"] >= target and lo is not None and lo > 0
    need_multi = result["protocol"] == "splits"
    ok = ok and (m["difference"] >= 0 or not need_multi)
    how = " (transductive pretraining)" if result["protocol"] == "scanners" else ""
    return (f"learning-check [{result['cue']}]{how}: {'PASS' if ok else 'FAIL'}: pretrained - random-init"
            f"{draws_said(result)} balanced accuracy "
            f"(test, both encoders through the head kind chosen on their mean val): {BINARY} "
            f"({b['pretrained_head']}) {b['difference']:+.3f} [{_f(lo)}, {_f(b['difference_ci95'][1])}] "
            f"({b['pretrained']:.3f} vs {b['random_init']:.3f}), {MULTI} ({m['pretrained_head']}) "
            f"{m['difference']:+.3f} [{_f(m['difference_ci95'][0])}, {_f(m['difference_ci95'][1])}] "
            f"({m['pretrained']:.3f} vs {m['random_init']:.3f}); target {BINARY} "
            f">= +{target:.2f} with the interval above 0{f', {MULTI} >= 0' if need_multi else ''}")


def draws_said(result: dict) -> str:
    """' (mean of K draws)' where random init is read over several draws; '' for one."""
    k = result.get("random_draws", 1)
    return f" (mean of {k} draws)" if k > 1 else ""


def draws_line(result: dict) -> str | None:
    """Each random-init draw's row for the binary task, through the headline's heads (None for one draw)."""
    c = headline_row(result["tasks"][BINARY])
    if "random_draws" not in c:
        return None
    seeds = result.get("random_init_seeds") or [None] * len(c["random_draws"])
    each = "; ".join(f"draw {d['draw']} (init seed {s}) {d['random_init']:.3f} ({d['head']}), pretrained - it {_diff(d)}"
                     for d, s in zip(c["random_draws"], seeds))
    return (f"Random init is the mean of {len(c['random_draws'])} encoders drawn with their own init seeds, each "
            f"read through the head kind chosen for the pair; {BINARY}: {each}.")


def _f(v) -> str:
    return "n/a" if v is None else f"{v:+.3f}"


def _diff(d: dict) -> str:
    return f"{d['difference']:+.3f} [{_f(d['difference_ci95'][0])}, {_f(d['difference_ci95'][1])}]"


def pct(fraction: float) -> str:
    """0.1 -> "10%", 0.104 -> "10.4%" (keys.percent: exact, so the jobs and rows named by it stay apart)."""
    return f"{percent(fraction)}%"
