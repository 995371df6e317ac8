"""The learning check as a benchmark section: `make learning-check` run as a subprocess (its
own cohort and cache under the bench folder), its verdict, the paired differences and the
wall and CPU seconds of each stage. --quick: a small cohort and a few steps (a smoke of the
code, not the result)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

QUICK = ["--participants", "24", "--bootstrap", "200", "max_steps=20", "ckpt_every=20", "log_every=10"]


def run(workdir: Path, quick: bool = False):
    workdir = Path(workdir)
    out = workdir / "result"
    args = [sys.executable, "-m", "evals.learning_check", "--work", str(workdir / "data"), "--out", str(out),
            *(QUICK if quick else [])]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    res = json.loads((out / "result.json").read_text())
    keep = {"verdict": res["verdict"], "step": res["step"], "stages": res["stages"],
            "tasks": {t: v["comparisons"]["chosen_on_val"] for t, v in res["tasks"].items()}}
    ref = res.get("supervised_reference") or {}
    keep["supervised_reference"] = ref
    lines = ["## Learning check (pretrained vs random-init encoder on the lesion cohort)", "", res["verdict"], ""]
    lines += [f"- supervised reference (the same encoder trained on the labels) - random-init, {t}: "
              f"{r['difference']:+.3f} [{r['difference_ci95'][0]:+.3f}, {r['difference_ci95'][1]:+.3f}] "
              f"({r['supervised']:.3f} vs {r['random_init']:.3f})" for t, r in ref.items()]
    lines += ["", "| stage | wall s | cpu s |", "|---|---|---|"]
    lines += [f"| {k} | {v['wall_s']} | {v['cpu_s']} |" for k, v in res["stages"].items()]
    lines += ["", f"Full report: {out / 'result.md'}"]
    return keep, lines
