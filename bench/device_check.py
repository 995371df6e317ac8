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
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

from bench.device_report import CHECK, PRODUCTION, markdown
from bench.recipe_bench import PLAIN
from octfm import cli

DATASHEET_BF16_TFLOPS = {"h100": 989.0, "h200": 989.0}  # dense, SXM (train/plan.py ACCELERATORS)
TINY = ["model.dim=32", "model.depth=2", "model.heads=2", "model.pred_dim=16", "model.pred_depth=1",
        "model.pred_heads=2"]


# ----------------------------------------------------------------------------- what each item costs
# The inputs of the predictions, measured on the CPU (2 cores at load 3.5-5, 2026-12-01; docs/accelerators.md, 10):
CPU_MEASURED = {
    "step_tflop": 73.4,           # one production step at batch 16, forward + backward (FlopCounterMode on fakes)
    "front_end_blocks_s": 2.9,    # dynamo + AOTAutograd of the step's five distinct block graphs (per-block compile)
    "front_end_whole_s": 36.4,    # the same for the whole step (`compile: true`): not what the GPU run compiles
    "first_use_s": 4.8,           # dynamo's and AOTAutograd's one-time costs in a fresh process
    "process_s": 4.7,             # a fresh python importing torch and the trainer
    "trainer_s": 10.2,            # a Trainer at the production config (ViT-B built and initialised)
    "batches_s": 18.5,            # three batches of 16 production crops read from disk (workers 0)
    "cache_s": 102.3,             # the production-shape cache: 24 generated participants (67.4 s), 54 volumes built
}
# What the GPU machine is assumed to do with them (each to be replaced by the GPU call's own figure):
GPU_ASSUMED = {
    "tflops": 190.0,              # the ViT-B step's achieved bf16 rate: 25% of the H200's measured 763 TFLOP/s
    "cuda_init_s": 5.0,           # the CUDA context and library handles of a fresh process
    "backend_x": 3.0,             # inductor's back end (lowering, Triton codegen and compile) per front-end second
    "parallel_x": 4.0,            # the cohort and cache builds on its 16 cores against these 2: half the core ratio
    "profile_s": 5.0,             # torch.profiler over five steps and its key_averages
    "cudnn_graphs_s": 10.0,       # cuDNN attention builds a graph per new shape: ~10 shapes x ~1 s (public reports)
    "check_step_s": 0.2,          # the check's step at 256: twice the H200's measured 100 ms at batch 128
    "check_cache_s": 65.0,        # 400 participants' cohort and cache: 3.1 x the H200's 128 participants' 21.6 s
    "run_startup_s": 30.0,        # make pretrain before its first step, without resident volumes or a probe
    "cuda_tests_s": 120.0,        # pytest -m cuda: not finished in the 148 s the first H200 call left it
}
STEPS = 1 + 3 + 3 * 5 + 5         # a measured step: the first (FLOPs), 3 warm, 3 rounds of 5, 5 profiled
CHECK_STEPS = 1 + 3 + 3 * 10 + 10
REFERENCE_STEPS = 3 + 5 * 5       # per contender: warm-up and 5 rounds of 5
RUN_STEPS = 200
CHECK_VOXELS = (3 * 256 * 32 * 96 * 96) / (3 * 16 * 64 * 384 * 384)  # the check's three batches against production's
CAP_FACTOR, CAP_SLACK_S = 2.0, 30.0   # an item is stopped at twice its prediction and 30 s
DRY_CAP_S = 1800.0                # the CPU rehearsal is timed by its test, not by the GPU's predictions


@dataclasses.dataclass(frozen=True)
class Item:
    """One thing the call may run: a section, or one variant of a section's step."""
    section: str
    variant: str | None
    predicted_s: float            # what it is expected to take on the GPU (0: it always starts)
    cap_s: float                  # where it is stopped (0: only by the budget's end)

    @property
    def key(self) -> str:
        return self.section if self.variant is None else f"{self.section}/{self.variant}"


ORDER = ["environment", "production/eager", "production/pred_heads_12", "production/cudnn_attention", "reference",
         "stem_conv", "production/compiled", "check/eager", "check/compiled", "run", "cuda_tests"]


def predicted_costs(measured: dict = CPU_MEASURED, gpu: dict = GPU_ASSUMED) -> dict[str, float]:
    """key -> predicted seconds on the GPU machine. A step item is a fresh process (python, CUDA,
    the trainer, its first batches: host work, taken as measured here), its steps at the measured
    FLOPs over the assumed GPU rate, the profile, and what it adds: the cache for the first item
    that reads it (a parallel build: measured / parallel_x), cuDNN's graph builds, the compile
    (the front end measured here, times 1 + the back end's multiplier)."""
    m, g = measured, gpu
    step = m["step_tflop"] / g["tflops"]
    start = m["process_s"] + g["cuda_init_s"] + m["trainer_s"]
    measured_step = start + m["batches_s"] + STEPS * step + g["profile_s"]
    compile_blocks = (m["first_use_s"] + m["front_end_blocks_s"]) * (1 + g["backend_x"])
    check = start + CHECK_VOXELS * m["batches_s"] + CHECK_STEPS * g["check_step_s"] + g["profile_s"]
    return {
        "environment": g["cuda_init_s"] + 5.0,  # and the 8192^3 bf16 matmuls
        "production/eager": m["cache_s"] / g["parallel_x"] + measured_step,
        "production/pred_heads_12": measured_step,
        "production/cudnn_attention": measured_step + g["cudnn_graphs_s"],
        # octfm's and vjepa2's models, four batches of 8, each contender's steps at half the production batch
        "reference": start + m["trainer_s"] + m["batches_s"] * 32 / 48 + 2 * REFERENCE_STEPS * step / 2,
        "stem_conv": m["process_s"] + g["cuda_init_s"] + 5.0,
        "production/compiled": measured_step + compile_blocks,
        "check/eager": g["check_cache_s"] + check,
        "check/compiled": check + compile_blocks,
        "run": start + g["run_startup_s"] + RUN_STEPS * step + 10.0,  # and its one checkpoint
        "cuda_tests": g["cuda_tests_s"],
    }


def plan_items(dry: bool = False) -> list[Item]:
    """The call's items in ORDER, each with its prediction and cap (the dry run's tiny sizes: a
    twentieth of the prediction, and caps the CPU's compiles fit in)."""
    costs = predicted_costs()
    items = []
    for key in ORDER:
        section, _, variant = key.partition("/")
        p = costs[key]
        cap = DRY_CAP_S if dry else round(CAP_FACTOR * p + CAP_SLACK_S)
        items.append(Item(section, variant or None, round(p / 20 if dry else p, 1), cap))
    return items


class Budget:
    """The call's seconds. An item starts only when its predicted cost fits in what is left, and
    runs at most its cap, or what is left when that is less. `clock` is injectable for tests."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock, self.t0 = seconds, clock, clock()

    def left(self) -> float:
        return self.seconds - (self.clock() - self.t0)


def refusal(predicted_s: float, left: float) -> str | None:
    """Why an item with this prediction does not start with `left` seconds left (None: it starts)."""
    return f"{predicted_s:.0f} s of budget needed, {left:.0f} s left" if predicted_s > left else None


def limit(item: Item, left: float | None) -> tuple[float | None, str]:
    """(seconds the item may run, what stops it there): its cap, or what is left when that is less
    (None: neither, no limit)."""
    if left is not None and (not item.cap_s or left < item.cap_s):
        return max(left, 1.0), "the budget's end"
    return item.cap_s or None, "its cap"


def budget_plan(items: Sequence[Item], budget_s: float) -> list[tuple[str, str | None]]:
    """What a budget buys if every item takes its predicted time: (key, None when it runs, else
    why it is skipped), in order. The same rule the call applies with the clock's real time."""
    left, out = budget_s, []
    for it in items:
        why = refusal(it.predicted_s, left)
        if why is None:
            left -= it.predicted_s
        out.append((it.key, why))
    return out


class CapReached(BaseException):
    """An item ran to its cap (or the budget's end) and was stopped. A BaseException, so that no
    `except Exception` on the way (a cache build's per-volume handler, say) swallows it."""


@contextlib.contextmanager
def capped(seconds: float | None):
    """Raise CapReached in this (main) thread after `seconds`: a subprocess.run waiting then is
    killed by its own cleanup. None: no cap."""
    if not seconds:
        yield
        return

    def ring(signum, frame):
        raise CapReached()

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Sizes:
    """What each section runs at: the real sizes on a GPU, tiny ones on the CPU (--dry-run)."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.device = "cpu" if dry else "cuda"
        self.crop = [16, 64, 64] if dry else [64, 384, 384]
        self.participants = 6 if dry else 24
        self.scale = 16 if dry else 2
        self.production = TINY if dry else []       # overrides on the production config
        self.batch = 2 if dry else None            # None: the config's (16 per process)
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


def make_cache(ctx: dict) -> Path:
    """A cache at the crop the sections train on: the generated cohort through the real build."""
    if "cache" in ctx:
        return ctx["cache"]
    from cache import build
    from cache.config import CacheConfig
    from ingest import synth
    from octfm import config

    s = ctx["sizes"]
    src, cache = ctx["work"] / "dataset", ctx["work"] / "cache"
    synth.generate(src, synth.SynthConfig(participants=s.participants, scale=s.scale, seed=0, bad_files=False,
                                          unlabeled=0, lesions=1.0))
    cfg = config.from_dict(CacheConfig, {"preprocess": {"target_shape": list(s.crop)}})
    build.build(str(src), str(cache), cfg, progress=False)
    ctx["cache"] = cache
    return cache


_STEP_CODE = r"""
import json, statistics, time, torch
from torch.utils.flop_counter import FlopCounterMode
from octfm import config
from train import pretrain, runtime
from train.config import TrainConfig
from train.model import Block
cfg = config.load(TrainConfig, {config!r}, {overrides!r})
rt = runtime.setup(cfg.device, cfg.precision)
tr = pretrain.Trainer(cfg, rt)
net = tr.network()
blocks = {blocks!r}
if blocks:  # each block on its own (student and target): one graph per distinct input signature, reused
    for m in [*tr.model.modules(), *tr.target.modules()]:
        if isinstance(m, Block):
            m.compile(dynamic=False)
_, dl = tr.loader(tr.rows, 0, augment=True, shuffle=True, seed=0)
it = iter(dl)
batches = [rt.to_device(next(it)) for _ in range(3)]
tr.lr.fill_(1e-4); tr.momentum.fill_(0.99)
def sync():
    if rt.kind == "cuda":
        torch.cuda.synchronize()
if rt.kind == "cuda":
    torch.cuda.reset_peak_memory_stats()
t = time.perf_counter()
if cfg.compile or blocks:  # compiled: the eager step's count stands (the parent copies it); a mode would retrace
    tr.update([batches[0]], net)
    flops = None
else:
    with FlopCounterMode(display=False) as fc:
        tr.update([batches[0]], net)
    flops = fc.get_total_flops()
sync()
first = time.perf_counter() - t
for i in range(3):
    tr.update([batches[i % 3]], net)
rounds = []
for r in range(3):
    sync(); t = time.perf_counter()
    for i in range({steps}):
        tr.update([batches[i % 3]], net)
    sync(); rounds.append((time.perf_counter() - t) / {steps})
peak = torch.cuda.max_memory_allocated() / 2 ** 30 if rt.kind == "cuda" else None
print(json.dumps({{"step_s": statistics.median(rounds), "rounds_s": rounds, "first_step_s": first,
                  "tokens": tr.grid.tokens, "batch": cfg.batch_size, "flops_per_step": flops,
                  "peak_gib": peak, "params_m": sum(p.numel() for p in tr.model.parameters()) / 1e6,
                  "compile": "per block" if blocks else cfg.compile}}), flush=True)  # the timing is kept if the profiling below fails
if {profile}:
    try:
        from bench.device_check import profile_summary
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.kind == "cuda" else [])
        with profile(activities=acts) as p:
            for i in range({steps}):
                tr.update([batches[i % 3]], net)
            sync()
        prof = profile_summary(p.key_averages(), {steps}, rt.kind == "cuda")
    except Exception as exc:
        prof = {{"profile_error": f"{{type(exc).__name__}}: {{exc}}"[:500]}}
    print(json.dumps(prof), flush=True)
"""

WAITS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")  # the host waiting, not working


def profile_summary(events, steps: int, cuda: bool, top: int = 12) -> dict:
    """Where a profiled step's time goes, per step, from torch.profiler's key_averages. On CUDA: the
    kernels' time summed as torch's own table sums it (device events only, not user annotations:
    a CPU op's self device time repeats its kernels'), which beside the unprofiled step time says
    whether the GPU or the host sets the pace (a busy share far below 1: the host's dispatch and
    launches leave the GPU waiting), the kernel launches, and the kernels that take the most time.
    Everywhere: the host's time in ops and runtime calls, less its waits for the device (an upper
    bound on dispatch: a launch blocks when the queue is full), and the aten op calls. On the CPU
    the top list ranks ops by host time."""
    def kind(e) -> str:
        return getattr(getattr(e, "device_type", None), "name", "CPU")

    def dev(e) -> float:  # microseconds; the attribute was renamed from cuda to device in torch 2.4
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)

    host = [e for e in events if kind(e) == "CPU" and not getattr(e, "is_user_annotation", False)]
    kernels = [e for e in events if kind(e) == "CUDA" and not getattr(e, "is_user_annotation", False)]
    ranked, cost = (kernels, dev) if cuda else (host, lambda e: float(e.self_cpu_time_total))
    out = {"profile_host_ms_per_step": sum(e.self_cpu_time_total for e in host if e.key not in WAITS) / steps / 1e3,
           "profile_op_calls_per_step": sum(e.count for e in host if e.key.startswith("aten::")) / steps,
           "profile_top": [[e.key[:80], round(cost(e) / steps / 1e3, 3), round(e.count / steps, 1)]
                           for e in sorted(ranked, key=cost, reverse=True)[:top]],
           "profile_device_ms_per_step": None}
    if cuda:
        if not kernels or not sum(map(dev, kernels)):
            return {"profile_error": "no CUDA kernel events in the profile (CUPTI unavailable?)"}
        out.update(profile_device_ms_per_step=sum(map(dev, kernels)) / steps / 1e3,
                   profile_kernels_per_step=sum(e.count for e in kernels) / steps)
    return out


def remaining(ctx: dict) -> float | None:
    """A subprocess's time limit: what the running item's limit leaves, less two seconds, so the
    subprocess is stopped (keeping what it printed) before the item's alarm rings (None: no limit)."""
    deadline = ctx.get("deadline")
    return None if deadline is None else max(1.0, deadline - time.monotonic() - 2.0)


def run_json(code: str, timeout: float | None, env: dict | None = None) -> dict:
    """Run `code` in a fresh Python and merge the JSON objects it prints, one per line. A process
    that fails after printing one keeps what it printed, its error under `late_error`; one that
    printed none raises with its stderr. One stopped at `timeout` keeps what it printed under
    `stopped`, or raises CapReached."""
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
        out, err, failed, stopped = r.stdout, r.stderr, r.returncode != 0, False
    except subprocess.TimeoutExpired as exc:
        as_text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        out, err, failed, stopped = as_text(exc.stdout), as_text(exc.stderr), True, True
    merged: dict = {}
    for line in out.splitlines():
        if line.startswith("{"):
            merged.update(json.loads(line))
    if stopped and not merged:
        raise CapReached()
    if stopped:
        merged["stopped"] = f"stopped after {timeout:.0f} s (its item's limit), what it printed kept"
    elif failed and not merged:
        raise RuntimeError(err[-4000:])
    elif failed:
        merged["late_error"] = err[-1000:]
    return merged


def plan_peak_gib(config_path: str, overrides: list[str], accel: str | None) -> float:
    """`make plan`'s peak per chip for this config at its batch (one process per GPU)."""
    from octfm import config
    from train import plan
    from train.config import TrainConfig

    return plan.make_plan(config.load(TrainConfig, config_path, overrides), accel or "h100", 1).peak_gib


def shape_arg(crop) -> str:
    return "data.input_shape=[" + ",".join(map(str, crop)) + "]"


def step_size(ctx: dict, name: str, config_path: str, overrides: list[str], crop, batch: int | None, steps: int,
              compile_: str | None = None, cache: Path | None = None, env: dict | None = None,
              profile: bool = False, flops: float | None = None) -> dict:
    """One config's step on the device (batch None: the config's). `compile_`: "blocks" compiles
    each transformer block on its own, "whole" the step as `compile: true` does. `profile`: then
    `steps` more steps under torch.profiler (profile_summary), after the timing. A compiled step
    takes its FLOPs from the eager one (`flops`). Beside the measured peak memory, `make plan`'s."""
    s = ctx["sizes"]
    base = [f"data.cache={cache or make_cache(ctx)}", f"runs_dir={ctx['work'] / 'runs'}", f"name=bench_{name}",
            f"device={s.device}", "precision=bf16", "data.workers=0", "wandb.enabled=false", "data.stride=[1,1,1]",
            "data.resident=never", shape_arg(crop)]
    whole = "true" if compile_ == "whole" else "false"
    over = base + overrides + ([f"batch_size={batch}"] if batch else []) + [f"compile={whole}"]
    r = run_json(_STEP_CODE.format(config=config_path, overrides=over, steps=steps, profile=profile,
                                   blocks=compile_ == "blocks"), timeout=remaining(ctx), env=env)
    r["flops_per_step"] = r["flops_per_step"] or flops
    r["plan_peak_gib"] = plan_peak_gib(config_path, over, ctx["env"].get("accel"))
    if r.get("peak_gib"):
        r["peak_over_plan"] = r["peak_gib"] / r["plan_peak_gib"]
    measured = ctx["env"]["matmul_bf16_tflops"] * 1e12
    r["tokens_per_s"] = r["batch"] * r["tokens"] / r["step_s"]
    if r["flops_per_step"]:
        r["achieved_tflops"] = r["flops_per_step"] / r["step_s"] / 1e12
        r["mfu"] = r["flops_per_step"] / r["step_s"] / measured  # against the bf16 matmul rate measured on this card
        if ctx["env"].get("datasheet_bf16_tflops"):
            r["mfu_of_datasheet"] = r["flops_per_step"] / r["step_s"] / (ctx["env"]["datasheet_bf16_tflops"] * 1e12)
    if r.get("profile_device_ms_per_step") is not None:
        r["gpu_busy_frac"] = r["profile_device_ms_per_step"] / 1e3 / r["step_s"]
    return r


def attempt(ctx: dict, item: Item, fn: Callable[[], dict]) -> dict:
    """Run one item under the budget's rules: skipped when its prediction does not fit in what is
    left (read once, for an item with a cost), stopped at its limit (`limit`), a failure recorded
    with its error. Its prediction and the seconds it took are kept beside its results."""
    left = None
    if item.predicted_s:
        left = ctx["left"]()
        why = refusal(item.predicted_s, left)
        if why:
            print(f"device-check: {item.key} skipped ({why})", flush=True)
            return {"skipped": why, "predicted_s": item.predicted_s}
    seconds, stop = limit(item, left)
    print(f"device-check: {item.key} (predicted {item.predicted_s:.0f} s, limit {seconds or 0:.0f} s) ...", flush=True)
    ctx["deadline"] = None if seconds is None else time.monotonic() + seconds
    t = time.monotonic()
    try:
        with capped(seconds):  # in-process work; a subprocess stops first, at its timeout (remaining)
            res = fn()
    except CapReached:
        res = {"stopped": f"stopped at {stop} ({seconds:.0f} s)"}
    except Exception as exc:  # noqa: BLE001 - one item's failure (an out-of-memory, say) is reported
        traceback.print_exc()
        res = {"error": f"{type(exc).__name__}: {exc}"[-1500:]}
    finally:
        ctx["deadline"] = None
    res.update(predicted_s=item.predicted_s, took_s=round(time.monotonic() - t, 1))
    return res


def variants(ctx: dict, section: str, todo: dict, run) -> dict:
    """Run `todo`'s variants in order (name -> spec; spec[-1]: an Item, or the predicted seconds,
    0 for always) under the budget (`attempt`), adding each result to the section's as it comes
    and writing the results after each; a skipped, stopped or failed one leaves the next to run."""
    out = dict(ctx["results"].get(section) or {})
    for name, spec in todo.items():
        cost = spec[-1]
        item = cost if isinstance(cost, Item) else Item(section, name, cost, cap_s=0)
        out[name] = attempt(ctx, item, lambda: run(name, spec, out))
        write_results(ctx, section, out)
    return out


def production(ctx: dict, items: dict[str, Item]) -> dict:
    """The ViT-B production step at its config's batch, `items`' variants (Sizes.production_variants),
    each profiled; a variant with the config's own step takes its FLOPs from the eager one."""
    s = ctx["sizes"]
    specs = s.production_variants()

    def one(name, spec, done):
        over, env, compiled, _ = spec
        eager = done.get("eager", {})
        return step_size(ctx, f"production_{name}", PRODUCTION, s.production + over, s.crop, s.batch, s.steps,
                         compile_=compiled, env=env, profile=True,
                         flops=eager.get("flops_per_step") if not over else None)

    return variants(ctx, "production", {k: (*specs[k], it) for k, it in items.items()}, one)


def reference(ctx: dict) -> dict:
    """octfm's eager bf16 step beside vjepa2's at equal work, measured until the item's deadline
    (what the rounds done by then say; the compiled step is production's, not compiled again here)."""
    from bench import reference_bench

    src = ctx["vjepa2"]
    if not src or not Path(src).exists():
        return {"skipped": f"no vjepa2 checkout at {src} (make wheelhouse VJEPA2_SRC=<checkout> copies one there)"}
    reference_bench.check_checkout(src)
    s = ctx["sizes"]
    batch = 2 if s.dry else 8  # both steps at the production crop without the stem and local term: vjepa2's work
    base = [f"data.cache={make_cache(ctx)}", f"runs_dir={ctx['work'] / 'runs'}", f"device={s.device}",
            "data.workers=0", "wandb.enabled=false", "data.resident=never", f"batch_size={batch}",
            shape_arg(s.crop), *PLAIN, *(TINY if s.dry else [])]
    shim = reference_bench.timm_shim(ctx["work"])
    rest = remaining(ctx)
    margin = None if rest is None else min(30.0, rest / 4)  # the last round's time, then the kill's
    try:
        res = reference_bench.measure_steps(src, shim, PRODUCTION, base, device=s.device,
                                            variants={"octfm bf16": ["precision=bf16"]},
                                            references={"vjepa2 bf16": True}, warmup=2 if s.dry else 3,
                                            rounds=2 if s.dry else 5, steps=2 if s.dry else 5,
                                            deadline=None if rest is None else time.time() + rest - margin,
                                            kill_after=0 if rest is None else margin - 0.5)
    except subprocess.TimeoutExpired:  # killed before it printed a thing
        raise CapReached() from None
    size = (f"{'tiny (dry run)' if s.dry else 'ViT-B (configs/pretrain_multi_domain.yaml, no stem, no local term)'}, "
            f"{'x'.join(map(str, s.crop))}, batch {batch}")
    res, lines = reference_bench.summarise(res, src, shim, size, precision="bf16")
    res["markdown"] = lines
    return res


_STEM_CODE = r"""
import json, statistics, time, torch
from octfm import config
from train.config import TrainConfig
from train.model import conv_stem
cfg = config.load(TrainConfig, {config!r}, {overrides!r})
dev = {device!r}
stem = conv_stem(cfg.model.stem).to(dev)
x = torch.rand({batch}, 1, *{crop!r}, device=dev)
def sync():
    if dev == "cuda":
        torch.cuda.synchronize()
def step():
    with torch.autocast(dev, dtype=torch.bfloat16):
        y = stem(x)
    y.float().mean().backward()
out = {{"stem": list(cfg.model.stem), "batch": {batch}, "crop": {crop!r}}}
for bench in (False, True):
    torch.backends.cudnn.benchmark = bench
    sync(); t = time.perf_counter(); step(); sync()
    first = time.perf_counter() - t  # with benchmark on: cuDNN tries its algorithms here
    rounds = []
    for r in range(3):
        sync(); t = time.perf_counter()
        for i in range({steps}):
            step()
        sync(); rounds.append((time.perf_counter() - t) / {steps})
    out["on" if bench else "off"] = {{"first_s": first, "step_ms": 1000 * statistics.median(rounds)}}
    print(json.dumps(out), flush=True)
"""


def stem_conv(ctx: dict) -> dict:
    """The stem's 3D convolution (model.stem of the production config, forward and backward in
    bf16 at the production batch and crop) with `torch.backends.cudnn.benchmark` off, then on:
    whether the pretraining should set it (a fixed shape pays its search once)."""
    s = ctx["sizes"]
    from octfm import config
    from train.config import TrainConfig

    batch = s.batch or config.load(TrainConfig, PRODUCTION).batch_size
    r = run_json(_STEM_CODE.format(config=PRODUCTION, overrides=s.production, device=s.device, batch=batch,
                                   crop=s.crop, steps=s.steps), timeout=remaining(ctx))
    if "on" in r:
        r["off_over_on"] = r["off"]["step_ms"] / r["on"]["step_ms"]
    return r


def check_cache(ctx: dict) -> Path:
    """A cache at the GPU-size learning check's shape: a small cohort from its generator config
    through its cache build (check/cohort.py)."""
    if "check_cache" not in ctx:
        from check import cohort as lc
        from ingest import synth

        src, cache = ctx["work"] / "check_dataset", ctx["work"] / "check_cache"
        synth.generate(src, dataclasses.replace(lc.COHORT, participants=ctx["sizes"].check_participants, seed=0))
        ctx["check_cache"] = Path(lc.build_cache(str(src), cache))
    return ctx["check_cache"]


def check_step(ctx: dict, items: dict[str, Item]) -> dict:
    """The GPU-size learning check's pretraining step at its batch (256), `items`' variants (eager;
    compiled, each block on its own), each profiled, with what the check's `max_steps` x
    `batch_size` samples take at that step."""
    from octfm import config
    from train.config import TrainConfig

    s = ctx["sizes"]
    path, over, crop, batch, steps = s.check
    recipe = config.load(TrainConfig, path)
    samples = recipe.max_steps * recipe.batch_size  # what the check's pretraining trains on

    def one(name, spec, done):
        r = step_size(ctx, f"check_{name}", path, over, crop, batch, steps, compile_=spec[0], cache=check_cache(ctx),
                      profile=True, flops=done.get("eager", {}).get("flops_per_step"))
        r["steps_for_the_check"] = -(-samples // r["batch"])  # the same samples as the recipe's steps
        r["pretrain_s"] = r["step_s"] * r["steps_for_the_check"]
        return r

    modes = {"eager": None, "compiled": "blocks"}
    return variants(ctx, "check", {k: (modes[k], it) for k, it in items.items()}, one)


def real_run(ctx: dict) -> dict:
    """A real `make pretrain` of the production config on the device, on a cache of the production
    shape, with the default loader workers and the volumes read from disk (data.resident=never: a
    real AI-READI cache is far larger than the card), for its data-wait share after the first interval."""
    from octfm import config
    from train import data
    from train.config import TrainConfig

    s = ctx["sizes"]
    run = ctx["work"] / "runs"
    steps = s.run_steps
    args = [sys.executable, "-m", "train.pretrain", "--config", PRODUCTION, "--no-progress", f"device={s.device}",
            f"data.cache={make_cache(ctx)}", f"runs_dir={run}", "name=device_run", "data.resident=never",
            shape_arg(s.crop), f"max_steps={steps}", f"log_every={max(1, steps // 10)}", "val_every=0", "eval_every=0",
            f"ckpt_every={steps}", "wandb.enabled=false", *s.production, *([f"batch_size={s.batch}"] if s.batch else [])]
    t = time.perf_counter()
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=remaining(ctx))
    except subprocess.TimeoutExpired:
        raise CapReached() from None
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-4000:])
    recs = [json.loads(x) for x in (run / "device_run" / "metrics.jsonl").read_text().splitlines()]
    start = next((x for x in recs if x.get("split") == "startup"), {})
    recs = [x for x in recs if x.get("split") == "train"][1:]  # after the first interval (warm-up)
    return {"workers": data.loader_workers(None), "steps": steps, "run_s": time.perf_counter() - t,
            "startup_s": start.get("total_s"), "data_wait_frac": statistics.mean(x["data_wait_frac"] for x in recs),
            "run_samples_per_s": statistics.mean(x["samples_per_s"] for x in recs),
            "batch": s.batch or config.load(TrainConfig, PRODUCTION).batch_size}


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


# ----------------------------------------------------------------------------- report
def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


OUT_STRING_LIMIT = 6000  # characters of any one string in device_check.json: OUT comes back from the GPU machine


def bounded(value):
    """`value` with every long string cut to its last OUT_STRING_LIMIT characters (errors end there)."""
    if isinstance(value, str) and len(value) > OUT_STRING_LIMIT:
        return "..." + value[-OUT_STRING_LIMIT:]
    if isinstance(value, dict):
        return {k: bounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [bounded(v) for v in value]
    return value


def write_results(ctx: dict, name: str | None = None, partial: dict | None = None) -> None:
    if name is not None:
        ctx["results"][name] = partial
    results = bounded(ctx["results"])
    (ctx["out"] / "device_check.json").write_text(json.dumps(results, indent=2, default=str))
    (ctx["out"] / "device_check.md").write_text("\n".join(markdown(results)) + "\n")


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
