"""The learning check as a benchmark section: `make learning-check` for each cue run as a
subprocess (cohorts and caches under the bench folder; the scanners cue reuses the lesions
cohort's pretraining), its verdict lines (one per question), the paired differences, the
label-efficiency curve and the wall and CPU seconds of each stage. --quick: a small cohort and a few steps (a smoke of the
code, not the result)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from check.cohort import CUES
from check.verdicts import verdict_lines

QUICK = ["--participants", "24", "--bootstrap", "200", "max_steps=20", "ckpt_every=20", "log_every=10"]


def one_cue(workdir: Path, cue: str, quick: bool) -> dict:
    out = workdir / "result"
    args = [sys.executable, "-m", "check.learning_check", "--cue", cue, "--work", str(workdir / "data"),
            "--out", str(out), *(QUICK if quick else [])]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"learning check, cue {cue}: {r.stderr[-3000:]}")
    return json.loads((out / cue / "result.json").read_text())


def run(workdir: Path, quick: bool = False):
    workdir = Path(workdir)
    keep, lines = {}, ["## Learning check (pretrained vs random-init encoder, one cue at a time)", ""]
    for cue in CUES:
        res = one_cue(workdir, cue, quick)
        keep[cue] = {"verdict": res["verdict"], "verdicts": verdict_lines(res), "step": res["step"],
                     "stages": res["stages"],
                     "tasks": {t: v["comparisons"]["chosen_on_val"] for t, v in res["tasks"].items()},
                     "supervised_reference": res.get("supervised_reference") or {},
                     "label_efficiency": res["label_efficiency"]}
        total = sum(v["wall_s"] for v in res["stages"].values())
        lines += [f"### {cue}", "", *verdict_lines(res), ""]
        for p in res["label_efficiency"]["points"]:
            sup = p.get("supervised")
            lines.append(f"- {round(100 * p['fraction'])}% of labels: pretrained {p['pretrained']['balanced_accuracy']:.3f}, "
                         f"random-init {p['random_init']['balanced_accuracy']:.3f}"
                         + (f", supervised {sup['balanced_accuracy']:.3f}" if sup else ""))
        lines += ["", "| stage | wall s | cpu s |", "|---|---|---|"]
        lines += [f"| {k} | {v['wall_s']} | {v['cpu_s']} |" for k, v in res["stages"].items()]
        lines += [f"| total | {total:.0f} | |", "", f"Full report: {workdir / 'result' / cue / 'result.md'}", ""]
    return keep, lines
