"""`make device-check OUT=<folder>`: the GPU path measured in one call on a lent H100/H200.

Run on the device machine (python3 with PyTorch and CUDA; the packages its image lacks come as
wheels from `make wheelhouse`, installed by bench/device_run.py into a temporary site folder, no
network). It writes `device_check.json` and `device_check.md` into OUT after every item, so a
call cut short keeps what it measured. OUT holds results only (those two, the CUDA tests' log);
the cohorts, caches, runs and checkpoints go to a scratch folder outside it (`--work`, default a
fresh folder under the system's temp), removed at the end, also when the call is stopped.

The items, in the order of what each tells per second of a ten-minute call:

- environment: the card, torch and CUDA, the measured bf16 matmul rate (what MFU divides by);
- production: the ViT-B step of configs/pretrain_multi_domain.yaml at its batch, bf16: eager,
  with `model.pred_heads=12` (head dim 32, the recipe before its 6 heads: docs/recipe.md, The predictor),
  with cuDNN attention first; each with ms per step, model FLOPs (torch.utils.flop_counter, on the eager
  step), MFU, the GPU's busy share (torch.profiler), and the peak memory beside `make plan`'s figure;
- reference: octfm's step beside facebookresearch/vjepa2's at equal work (bench/reference_bench.py),
  from a checkout carried in .device/vjepa2 (`make wheelhouse VJEPA2_SRC=...`);
- stem_conv: the stem's 3D convolution with `torch.backends.cudnn.benchmark` off and on;
- production, compiled: each transformer block compiled on its own (the choice of
  bench/compile_cost.py's measurement: a twelfth of the whole step's front end, docs/accelerators.md);
- check: the GPU-size learning check's pretraining step (configs/pretrain_check_gpu.yaml, batch
  256), eager and compiled, each profiled;
- run: a real `make pretrain` of the production config on a cache of the production shape, with
  the default loader workers and the volumes read from disk, and its data-wait share;
- cuda_tests: `pytest -m cuda` (tests/test_cuda.py).

Each item has a predicted cost and a cap (`predicted_costs`): it starts only when its predicted
seconds fit in what `--budget-s` leaves, else it is recorded as skipped with both numbers, and
one still running at its cap is stopped and recorded so. `--dry-run` runs the same code on the
CPU at tiny sizes (the heavy test lane runs it).

Its parts: the budget and each item under it (bench/device_budget.py), the steps it measures
(bench/device_steps.py), the report and result files (bench/device_report.py).
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from bench.device_budget import RUN_STEPS, Budget, Item, attempt, plan_items, remaining
from bench.device_report import CHECK, markdown, write_results
from bench.device_steps import TINY, check_step, production, real_run, reference, stem_conv
from octfm import cli

DATASHEET_BF16_TFLOPS = {"h100": 989.0, "h200": 989.0}  # dense, SXM (train/plan.py ACCELERATORS)


class Sizes:
    """What each section runs at: the real sizes on a GPU, tiny ones on the CPU (--dry-run)."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.device = "cpu" if dry else "cuda"
        self.crop = [16, 64, 64] if dry else [64, 384, 384]
        self.participants = 6 if dry else 24
        self.scale = 16 if dry else 2
        self.production = TINY if dry else []       # overrides on the production config
        self.batch = 2 if dry else None            # None: a card's batch in the GPU recipe (bench.card_batch: 16)
        self.steps = 2 if dry else 5               # timed steps per round (three rounds), then as many profiled
        # the GPU-size learning check's step (configs/pretrain_check_gpu.yaml): config, overrides, crop, batch, steps
        self.check = (CHECK, TINY if dry else [], [32, 96, 96], 2 if dry else 256, 2 if dry else 10)
        self.check_participants = 12 if dry else 400  # about 640 train volumes: more than a batch of 256
        self.run_steps = 8 if dry else RUN_STEPS

    def production_variants(self) -> dict:
        """name -> (overrides, environment, compile: None, or "blocks" for each block on its own)."""
        from train import attention

        return {
            "eager": ([], {}, None),
            # the predictor's head dim 32 (384 / 12), the recipe before it took 6 heads (head dim 64; docs/recipe.md):
            # what the adoption buys on the GPU; the dry run's 16-wide predictor: 16
            "pred_heads_12": ([f"model.pred_heads={1 if self.dry else 12}"], {}, None),
            "cudnn_attention": ([], {attention.CUDNN_ENV: "1"}, None),
            "compiled": ([], {}, "blocks"),
        }


def accelerator(name: str) -> str | None:
    low = name.lower()
    return next((k for k in DATASHEET_BF16_TFLOPS if k in low), None)


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- sections
def environment(ctx: dict) -> dict:
    import torch

    out = {"torch": torch.__version__, "python": platform.python_version(), "cpus": len(os.sched_getaffinity(0))}
    n, reps = (512, 3) if ctx["sizes"].dry else (8192, 10)
    dev = ctx["sizes"].device
    if dev == "cuda":
        p = torch.cuda.get_device_properties(0)
        arch = torch.cuda.get_arch_list()
        out.update(device=p.name, memory_gib=round(p.total_memory / 2 ** 30, 1), capability=f"{p.major}.{p.minor}",
                   cuda=torch.version.cuda, accel=accelerator(p.name), arch_list=arch,
                   # without machine code for this card every kernel is compiled from PTX at its first use
                   # (a lead for the 97 s before the first H200 step, docs/accelerators.md)
                   sass_for_device=f"sm_{p.major}{p.minor}" in arch)
    else:
        out.update(device="CPU (dry run)", accel=None)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(3):
        sync(dev)
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(dev)
        times.append((time.perf_counter() - t) / reps)
    out["matmul_bf16_tflops"] = 2 * n ** 3 / statistics.median(times) / 1e12
    out["datasheet_bf16_tflops"] = DATASHEET_BF16_TFLOPS.get(out["accel"])
    ctx["env"] = out
    return out


def cuda_tests(ctx: dict) -> dict:
    xml = ctx["work"] / "cuda_tests.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_cuda.py", "-p", "no:cacheprovider",
                        f"--junitxml={xml}", "-rs"], capture_output=True, text=True, timeout=remaining(ctx))
    (ctx["out"] / "cuda_tests.log").write_text(r.stdout[-20000:] + r.stderr[-5000:])  # bounded: OUT comes back
    import xml.etree.ElementTree as ET

    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": failed, "returncode": r.returncode}


# sections of one item each; production and check run their variants (`variants`)
SECTIONS: dict[str, Callable[[dict], dict]] = {"environment": environment, "reference": reference,
                                               "stem_conv": stem_conv, "run": real_run, "cuda_tests": cuda_tests}


WITH_VARIANTS = {"production": production, "check": check_step}


def groups(items: Sequence[Item]) -> list[tuple[str, list[Item]]]:
    """Consecutive items of one section, in order: production's first three, then the reference
    and the stem, then production's compiled variant, ..."""
    out: list[tuple[str, list[Item]]] = []
    for it in items:
        if out and out[-1][0] == it.section and it.variant:
            out[-1][1].append(it)
        else:
            out.append((it.section, [it]))
    return out


# ----------------------------------------------------------------------------- the call
def scratch(work: str | None, out: Path) -> Path:
    """The scratch folder: `work`, or a fresh one under the system's temp; never inside OUT,
    whose every file comes back from the GPU machine."""
    if work is None:
        return Path(tempfile.mkdtemp(prefix="octfm-device-check-"))
    path = Path(work).resolve()
    if path == out.resolve() or out.resolve() in path.parents:
        raise cli.UsageError(f"make device-check: --work {work} is inside OUT ({out}); OUT holds results only")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def stop_on_sigterm(signum, frame):
    """`timeout` sends SIGTERM: leave through the `finally` that removes the scratch folder."""
    raise SystemExit(128 + signum)


def run_items(ctx: dict, items: Sequence[Item]) -> None:
    """Every item in order under the budget, the results written after each."""
    for section, group in groups(items):
        t = time.perf_counter()
        if section in WITH_VARIANTS:
            res = WITH_VARIANTS[section](ctx, {it.variant: it for it in group})
            res["section_s"] = round(res.get("section_s", 0) + time.perf_counter() - t, 1)
        else:
            res = attempt(ctx, group[0], lambda: SECTIONS[section](ctx))
            res["section_s"] = round(time.perf_counter() - t, 1)
        ctx["results"]["total_s"] = time.perf_counter() - ctx["t0"]
        write_results(ctx, section, res)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make device-check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for device_check.json and .md (results only)")
    ap.add_argument("--dry-run", action="store_true", help="the same code on the CPU at tiny sizes")
    ap.add_argument("--vjepa2", default=".device/vjepa2", help="a facebookresearch/vjepa2 checkout (src/, app/)")
    ap.add_argument("--budget-s", type=float, default=480,
                    help="seconds; each item starts only when its predicted cost fits in what is left "
                         "(predicted_costs), and is stopped at its cap")
    ap.add_argument("--only", action="append", choices=sorted([*SECTIONS, *WITH_VARIANTS]))
    ap.add_argument("--work", default=None, help="scratch folder outside OUT (default: a fresh one under the "
                                                 "system's temp), removed at the end")
    a = ap.parse_args(argv)
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        raise cli.UsageError("make device-check: no CUDA device here (use --dry-run for the CPU rehearsal)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = scratch(a.work, out)
    budget = Budget(a.budget_s)
    items = [it for it in plan_items(a.dry_run) if it.section == "environment" or not a.only or it.section in a.only]
    ctx = {"out": out, "work": work, "sizes": Sizes(a.dry_run), "vjepa2": a.vjepa2, "left": budget.left,
           "t0": time.perf_counter(),
           "results": {"dry_run": a.dry_run, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": a.budget_s,
                       "plan": [[it.key, it.predicted_s, it.cap_s] for it in items]}}
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        run_items(ctx, items)
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(markdown(ctx["results"])))
    print(f"device-check: wrote {out / 'device_check.json'} and {out / 'device_check.md'}")
    return 0


if __name__ == "__main__":
    cli.run(main)
