"""The learning check's result files: result.md, result.png, result.json, and the demo's one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from check.cohort import BINARY, MULTI
from check.verdicts import SEEDS_RESAMPLED, _diff, chosen_on_val, draws_line, draws_said, headline_row, pct
from octfm import cli, fsio, plots


STANDARDIZED = {True: "The heads read each feature channel standardised by the training rows' statistics.",
                False: "The heads read the features as they are, each token (the linear head: the pooled vector) "
                       "normalised on its own (`--probe standardize=false`)."}


def tuned_line(run: dict) -> str:
    """One fine-tuning run in result.md: its head, best epoch and val per epoch."""
    seed = "" if run["train_seed"] is None else f", training seed {run['train_seed']}"
    return (f"- {pct(run['fraction'])}, {run['init']} init{seed}, {run['head']} head: best epoch "
            f"{run['best_epoch']} of {run['epochs_run']}; " + " ".join(f"{v:.2f}" for v in run["val"]))


def markdown(result: dict) -> str:
    """result.md: the verdicts and the headline tables; an interim result stops there, a final one goes
    on with the reference, label efficiency, fine-tuning, the pretraining and the stages' times."""
    lines = [*_headline(result), *_task_tables(result), *_per_scanner(result)]
    if result.get("interim"):  # the headline rows only (interim)
        return "\n".join(lines + [result["interim"] + ".", ""])
    lines += [*_reference(result), *_label_efficiency(result), *_finetuning(result), *_pretraining(result)]
    lines += ["", "| stage | wall s | cpu s |", "|---|---|---|"]
    lines += [f"| {k}{' (at once, its own process)' if v.get('together') else ''} | {v['wall_s']} | "
              f"{'' if v['cpu_s'] is None else v['cpu_s']} |" for k, v in result["stages"].items()]
    return "\n".join(lines) + "\n"


def _headline(result: dict) -> list[str]:
    held_out = " (each test row scored by probes trained on the other three scanners)" \
        if result["protocol"] == "scanners" else ""
    efficiency = (result.get("label_efficiency") or {}).get("verdict")
    return [f"# Learning check: {result['cue']}", "", result["verdict"], "", *([efficiency, ""] if efficiency else []),
            f"Cue: {result['what']}. Source `{result['source']}`, cache `{result['cache']}`, run `{result['run']}` "
            f"(step {result['step']}; objective: {result.get('objective', 'not recorded')}). "
            f"Intervals: 95% bootstrap over test participants ({result['bootstrap']} resamples); a difference "
            f"is paired (both encoders scored on each resample){held_out}. "
            f"{STANDARDIZED[result.get('probe_standardize', False)]}", ""]


def _task_tables(result: dict) -> list[str]:
    """Each task's comparisons (head choices) and the random-init draws' line."""
    lines = []
    for task, t in result["tasks"].items():
        lines += [f"## {task} ({t['classes']} classes; test: {t['test_rows']} volumes, {t['test_participants']} "
                  f"participants; majority class {t['majority_class']:.3f})", "",
                  "| heads | val: pretrained / random | test: pretrained | test: random-init | "
                  "test: pretrained - random [95% CI] |", "|---|---|---|---|---|"]
        for label, c in t["comparisons"].items():
            heads = c["pretrained_head"] if c["pretrained_head"] == c["random_head"] else \
                f"{c['pretrained_head']} / {c['random_head']}"
            lines.append(f"| {label} ({heads}) | {_num(c['val']['pretrained'])} / {_num(c['val']['random_init'])} | "
                         f"{c['pretrained']:.3f} | {c['random_init']:.3f} | {_diff(c)} |")
        lines.append("")
    if draws_line(result):
        lines += [draws_line(result), ""]
    return lines


def _per_scanner(result: dict) -> list[str]:
    if not result.get("per_scanner"):
        return []
    return [f"Each scanner held out ({BINARY}, heads chosen on the other scanners' val rows):", "",
            "| held-out scanner | participants | pretrained | random-init | pretrained - random [95% CI] |",
            "|---|---|---|---|---|",
            *(f"| {d} | {r['participants']} | {r['pretrained']:.3f} | {r['random_init']:.3f} | {_diff(r)} |"
              for d, r in result["per_scanner"].items()), ""]


def _reference(result: dict) -> list[str]:
    """The supervised reference against random init, and how each reference trained."""
    lines = []
    ref = result.get("supervised_reference")
    if ref:
        lines += ["Supervised reference: the same encoder trained from scratch on the diabetic labels of the train split "
                  "(`make finetune` from random init, the fine-tuning rows' recipe; it sees labels that pretraining never "
                  "does), its frozen features probed like the pretrained one's. It measures how far label-aware features "
                  "of this architecture get on this cohort.", "",
                  "| task | supervised (head) | random-init | supervised - random [95% CI] |", "|---|---|---|---|"]
        lines += [f"| {t} | {r['supervised']:.3f} ({r['head']}) | {r['random_init']:.3f} | {_diff(r)} |"
                  for t, r in ref.items()]
        lines.append("")
    if result.get("supervised_training"):
        lines += [reference_training_line(result["supervised_training"]), ""]
    return lines


def _label_efficiency(result: dict) -> list[str]:
    pts = result["label_efficiency"]["points"]
    with_sup = any("supervised" in p for p in pts)  # a reference at some fractions only (reference_fractions)
    lines = [f"Label efficiency ({result['label_efficiency']['task']}, test balanced accuracy, heads chosen on the "
             "full val rows; probes trained on a stratified, nested fraction of the labelled train participants"
             f"{', the supervised reference trained on the same ones' if with_sup else ''}"
             f"{head_steps(result['label_efficiency'])}):", "",
             f"| labels (participants) | pretrained | random-init{draws_said(result)} | " +
             ("supervised | " if with_sup else "") +
             "pretrained - random [95% CI] |" + (" pretrained - supervised [95% CI] |" if with_sup else ""),
             "|---|---|---|---|" + ("---|---|" if with_sup else "")]
    for p in pts:
        enc = [f"{p[e]['balanced_accuracy']:.3f}" for e in ("pretrained", "random_init")]
        if with_sup:
            enc.append(f"{p['supervised']['balanced_accuracy']:.3f}" if "supervised" in p else "")
        lines.append(f"| {pct(p['fraction'])} ({p['participants']}) | " + " | ".join(enc) +
                     f" | {_diff(p['pretrained_minus_random_init'])} |" +
                     ((f" {_diff(p['pretrained_minus_supervised'])} |" if "supervised" in p else " |") if with_sup else ""))
    lines.append("")
    return lines


def _finetuning(result: dict) -> list[str]:
    """The fine-tuning rows: their verdict, the table, each seed and each run (none when not asked)."""
    if not result.get("finetune"):
        return []
    n_seeds = result["finetune"]["points"][0].get("train_seeds", 1)
    lines = [f"Fine-tuning ({BINARY}, `make finetune` with configs/finetune.yaml on the same participants; the "
             "best val epoch scored on test): from the checkpoint and from random init, against the frozen "
             "probe of the checkpoint (head chosen on val) and the supervised reference trained on the same labels"
             + (f"; fine-tuned rows are means over {n_seeds} training seeds" if n_seeds > 1 else "") + ".", "",
             result["finetune"]["verdict"], "", *([result["finetune"]["against_supervised"], ""]
                                                  if result["finetune"].get("against_supervised") else []),
             "| labels | fine-tuned | fine-tuned random-init | frozen (head chosen on val) | supervised reference | "
             "fine-tuned - random [95% CI] | fine-tuned - frozen [95% CI] | fine-tuned - supervised [95% CI] |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {pct(p['fraction'])} | {p['pretrained']['balanced_accuracy']:.3f} | "
              f"{p['random_init']['balanced_accuracy']:.3f} | {p['frozen']['balanced_accuracy']:.3f} | "
              f"{_num(p['supervised']['balanced_accuracy']) if 'supervised' in p else ''} | "
              f"{_diff(p['pretrained_minus_random_init'])} | {_diff(p['finetuned_minus_frozen'])} | "
              f"{_diff(p['finetuned_minus_supervised']) if 'finetuned_minus_supervised' in p else ''} |"
              for p in result["finetune"]["points"]]
    if n_seeds > 1:
        lines += ["", *(f"Per training seed at {pct(p['fraction'])}: fine-tuned "
                        f"{', '.join(f'{v:.3f}' for v in p['per_seed']['pretrained'])}; random-init "
                        f"{', '.join(f'{v:.3f}' for v in p['per_seed']['random_init'])}"
                        + (f"; fine-tuned - random with the training seeds resampled as well as the participants: "
                           f"{_diff(p[SEEDS_RESAMPLED])}"
                           if SEEDS_RESAMPLED in p else "") + "."
                        for p in result["finetune"]["points"])]
    if result["finetune"].get("runs"):
        lines += ["", "Each run's val balanced accuracy per epoch (the encoder frozen for configs/finetune.yaml's "
                  "frozen_epochs first):", "",
                  *(tuned_line(r) for r in result["finetune"]["runs"])]
    lines.append("")
    return lines


def _pretraining(result: dict) -> list[str]:
    """The token probe's line, the pretraining's loss and RankMe, and its online-probe curve."""
    lines = []
    if result.get("token_probe"):
        lines += [f"Is the lesion in the tokens? {result['token_probe']['line']} (check/token_probe.py).", ""]
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
    return lines

def _num(v) -> str:
    return "" if v is None else f"{v:.3f}"


def plot(result: dict, path: Path) -> None:
    """Test balanced accuracy per encoder (the headline's heads) with intervals, the
    label-efficiency curve, and the online probe."""
    plt = plots.pyplot()
    curve = result["online_probe"]
    fig, axes = plt.subplots(1, 3 if curve else 2, figsize=(15 if curve else 10, 4), squeeze=False)
    ax = axes[0][0]
    for i, (task, t) in enumerate(result["tasks"].items()):
        c = headline_row(t)
        for j, (name, v, ci) in enumerate((("pretrained", c["pretrained"], c["pretrained_ci95"]),
                                           ("random-init", c["random_init"], c["random_init_ci95"]),
                                           ("majority", t["majority_class"], None))):
            err = None if not ci or ci[0] is None else [[v - ci[0]], [ci[1] - v]]
            ax.bar(i * 4 + j, v, yerr=err, color=f"C{j}", label=name if i == 0 else None, capsize=3)
    ax.set_xticks([1, 5], list(result["tasks"]))
    ax.set_ylabel("test balanced accuracy")
    ax.legend(fontsize=8)
    ax.set_title(f"{result['cue']}: one head kind for both, chosen on val, 95% participant bootstrap", fontsize=9)
    ax = axes[0][1]
    pts = result["label_efficiency"]["points"]
    x = [100 * p["fraction"] for p in pts]
    for j, name in enumerate(("pretrained", "random_init", "supervised")):
        have = [p for p in pts if name in p]  # the supervised encoder at some fractions only
        if have:
            v = [p[name]["balanced_accuracy"] for p in have]
            lo = [p[name]["ci95"][0] if p[name]["ci95"][0] is not None else p[name]["balanced_accuracy"] for p in have]
            hi = [p[name]["ci95"][1] if p[name]["ci95"][1] is not None else p[name]["balanced_accuracy"] for p in have]
            ax.errorbar([100 * p["fraction"] for p in have], v, yerr=[np.subtract(v, lo), np.subtract(hi, v)],
                        marker="o", capsize=3, color=f"C{j}",
                        label=name.replace("_", "-"))
    tuned = (result.get("finetune") or {}).get("points", [])
    for j, name in enumerate(("pretrained", "random_init") if tuned else ()):
        ax.plot([100 * p["fraction"] for p in tuned], [p[name]["balanced_accuracy"] for p in tuned], "s--",
                color=f"C{j}", alpha=0.7, label=f"fine-tuned {name.replace('_', '-')}")
    ax.set_xscale("log")
    ax.set_xticks(x, [f"{v:g}%" for v in x])
    ax.set_xlabel("labelled train participants")
    ax.set_ylabel(f"test balanced accuracy ({result['label_efficiency']['task']})")
    ax.legend(fontsize=8)
    ax.set_title("label efficiency", fontsize=9)
    if curve:
        ax = axes[0][2]
        for k in sorted({k for r in curve for k in r if k != "step"}):
            pts = [(r["step"], r[k]) for r in curve if r.get(k) is not None]
            ax.plot(*zip(*pts), marker="o", label=k)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.set_title("online probe", fontsize=9)
    fig.tight_layout()
    fsio.atomic_write_bytes(str(path), plots.to_png(fig, dpi=90))
    plt.close(fig)


def head_steps(curve: dict) -> str:
    """The heads' update count below all labels (docs/recipe.md, Probes); a result without it says nothing."""
    n = curve.get("head_steps")
    if not n:
        return ""
    each = f"{n[0]:,}" if len(set(n)) == 1 else f"{min(n):,}-{max(n):,}, each fold its own"
    return f"; below all labels the heads train as many optimizer steps as all labels' ({each})"


def reference_training_line(training: dict) -> str:
    """How each supervised reference trained, from reference_training's records."""
    if not training:
        return ""

    def one(frac: str, t: dict) -> str:
        where = f"step {t['best_step']}" if t.get("val_every") else f"epoch {t['best_epoch']}"
        best = t.get("best_val_balanced_accuracy")
        return (f"{frac} of labels {t['steps_run']} steps ({t['epochs_run']} epochs), best val "
                f"{'-' if best is None else f'{best:.3f}'} at {where}")
    return ("Reference training (make finetune from random init, configs/finetune.yaml with the size's keys; the best "
            "val score's state kept): " + "; ".join(one(f, t) for f, t in training.items()) + ".")


PREVIOUS = "previous"  # <out>/<cue>/previous/: the result files of the run before this one


def set_aside_results(dest: Path) -> list[str]:
    """Move an earlier run's result files (result.*, result_interim.*) from dest into dest/previous/
    (replacing what an older run left there): a run cut short then leaves only its own interim
    result, never another run's final one beside it (make learning-check-device copies result*)."""
    found = sorted(p for p in dest.glob("result*") if p.is_file())
    if found:
        shutil.rmtree(dest / PREVIOUS, ignore_errors=True)
        (dest / PREVIOUS).mkdir()
        for p in found:
            p.rename(dest / PREVIOUS / p.name)
    return [p.name for p in found]


def write_result(result: dict, dest: Path, stem: str) -> None:
    """<stem>.json and <stem>.md in dest, each written atomically."""
    dest.mkdir(parents=True, exist_ok=True)
    fsio.atomic_write_bytes(str(dest / f"{stem}.json"), json.dumps(result, indent=2, default=float).encode())
    fsio.atomic_write_bytes(str(dest / f"{stem}.md"), markdown(result).encode())


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
