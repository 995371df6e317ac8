"""XLA benchmarks (TPU issue): compile count and seconds for the smoke run, and steps/s on
XLA's CPU backend beside eager CPU, both in the torch_xla venv (same torch, same run)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from bench.train_bench import _make_cache

SMOKE = "configs/pretrain_smoke.yaml"


def _run(python: str, device: str, cache: Path, runs: Path, steps: int) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "OCTFM_XLA_CACHE": str(runs / "xla_cache")}
    args = [python, "-m", "train.pretrain", "--config", SMOKE, "--no-progress", f"device={device}",
            f"data.cache={cache}", f"runs_dir={runs}", f"name={device}", f"max_steps={steps}", "log_every=10",
            "val_every=0", f"ckpt_every={steps}", "data.workers=2"]
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    recs = [json.loads(x) for x in (runs / device / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in recs if x["split"] == "train"]
    steady = train[1:]  # the first interval holds start-up and compilation
    sps = sum(x["samples_per_s"] for x in steady) / len(steady)
    out = {"steps_per_s": sps / 4, "samples_per_s": sps}  # smoke batch 4
    if device == "xla":
        out.update(compiles=train[-1]["xla_compiles"], compile_s=train[-1]["xla_compile_s"],
                   compiles_by_step={x["step"]: x["xla_compiles"] for x in train})
    return out


def run(workdir: Path, quick: bool = False, xla_python: str | None = None):
    if not xla_python or not Path(xla_python).exists():
        return {"skipped": "no torch_xla venv (make xla-venv)"}, ["## XLA (TPU issue)", "",
                                                                  "Skipped: no torch_xla venv (`make xla-venv`)."]
    workdir = Path(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    cache = _make_cache(workdir)
    steps = 30 if quick else 60
    x = _run(xla_python, "xla", cache, workdir / "runs", steps)
    c = _run(xla_python, "cpu", cache, workdir / "runs", steps)
    shutil.rmtree(workdir, ignore_errors=True)
    res = {"xla": x, "eager_cpu": c, "steps": steps, "xla_over_eager": round(x["steps_per_s"] / c["steps_per_s"], 2)}
    lines = [
        "## XLA (TPU issue): smoke config on PJRT's CPU backend, one device, torch 2.9 + torch_xla 2.9",
        "",
        f"- Compilations over {steps} steps (logging every 10, a checkpoint at the end): {x['compiles']}, "
        f"{x['compile_s']:.1f} s in all; by step: {x['compiles_by_step']}",
        f"- Steady-state steps/s: XLA-CPU {x['steps_per_s']:.2f}, eager CPU {c['steps_per_s']:.2f} "
        f"(ratio {res['xla_over_eager']}; for reference only: XLA's CPU backend is not where speed is meant).",
    ]
    return res, lines
