"""`make device-check OUT=<folder>`: the GPU path measured in one call on a lent H100/H200.

Run on the device machine (python3 with PyTorch and CUDA; the packages its image lacks come as
wheels from `make wheelhouse`, installed by the Makefile into a temporary site folder, no
network). It writes `device_check.json` and `device_check.md` into OUT after every section, so a
call cut short keeps what it measured. Sections, in the order issue 62 gives them (the production
step first; each later one runs only while `--budget-s` leaves it the time it needs):

- environment: the card, torch and CUDA, the measured bf16 matmul rate (what MFU divides by);
- production: the ViT-B step of configs/pretrain_multi_domain.yaml at its batch, bf16: eager,
  compiled, with cuDNN attention first, and with `model.pred_heads=6` (head dim 64); each with ms
  per step, model FLOPs (torch.utils.flop_counter, on the eager step), MFU, the GPU's busy share
  (torch.profiler), and the peak memory beside `make plan`'s figure;
- reference: octfm's step beside facebookresearch/vjepa2's at equal work (bench/reference_bench.py),
  from a checkout carried in .device/vjepa2 (`make wheelhouse VJEPA2_SRC=...`);
- check: the GPU-size learning check's pretraining step (configs/pretrain_check_gpu.yaml, batch
  256), eager and compiled, each profiled;
- run: a real `make pretrain` of the production config on a cache of the production shape, with
  the default loader workers and the volumes read from disk, and its data-wait share;
- cuda_tests: `pytest -m cuda` (tests/test_cuda.py).

`--dry-run` runs the same code on the CPU at tiny sizes (the heavy test lane runs it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

from bench.device_report import CHECK, PRODUCTION, markdown
from octfm import cli

DATASHEET_BF16_TFLOPS = {"h100": 989.0, "h200": 989.0}  # dense, SXM (train/plan.py ACCELERATORS)
TINY = ["model.dim=32", "model.depth=2", "model.heads=2", "model.pred_dim=16", "model.pred_depth=1",
        "model.pred_heads=2"]
NO_STEM = ["model.stem=[]", "model.stem_pool=none", "model.pool=mean", "loss.local=0"]  # what vjepa2 computes


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
        self.run_steps = 8 if dry else 200

    def seconds(self, needed: float) -> float:
        """A section's or variant's time need, scaled down for the dry run's tiny sizes."""
        return needed / 20 if self.dry else needed

    def production_variants(self) -> dict:
        """name -> (overrides, environment, compiled, seconds of budget it needs to start)."""
        from train import attention

        return {
            "eager": ([], {}, False, 0),
            "compiled": ([], {}, True, self.seconds(150)),  # inductor compiles the ViT-B step: a minute or two
            "cudnn_attention": ([], {attention.CUDNN_ENV: "1"}, False, self.seconds(45)),
            # the predictor's head dim 64 (384 / 6) instead of 32; the dry run's 16-wide predictor: 16
            "pred_heads_6": ([f"model.pred_heads={1 if self.dry else 6}"], {}, False, self.seconds(45)),
        }


# sections after `environment`, in order: the budget each needs left to start (the production step always runs)
SECTION_NEEDS = {"production": 0, "reference": 60, "check": 60, "run": 90, "cuda_tests": 90}


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
    xml = ctx["out"] / "cuda_tests.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_cuda.py", "-p", "no:cacheprovider",
                        f"--junitxml={xml}", "-rs"], capture_output=True, text=True, timeout=time_limit(ctx))
    (ctx["out"] / "cuda_tests.log").write_text(r.stdout[-20000:] + r.stderr[-5000:])
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
cfg = config.load(TrainConfig, {config!r}, {overrides!r})
rt = runtime.setup(cfg.device, cfg.precision)
tr = pretrain.Trainer(cfg, rt)
net = tr.network()
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
if cfg.compile:  # compiled: the eager step's count stands (the parent copies it); a dispatch mode would retrace
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
                  "compile": cfg.compile}}), flush=True)  # the timing is kept if the profiling below fails
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


def time_limit(ctx: dict) -> float:
    """A subprocess's time limit: what the budget leaves, and at least a minute (the section ends;
    the production step's eager variant, which always runs, gets four)."""
    return max(240.0 if "production" not in ctx["results"] else 60.0, ctx["left"]())


def run_json(code: str, timeout: float, env: dict | None = None) -> dict:
    """Run `code` in a fresh Python and merge the JSON objects it prints, one per line. A process
    that fails or runs out of time after printing one keeps what it printed, its error under
    `late_error`; one that printed none raises with its stderr."""
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
        out, err, failed = r.stdout, r.stderr, r.returncode != 0
    except subprocess.TimeoutExpired as exc:
        as_text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        out, err, failed = as_text(exc.stdout), as_text(exc.stderr) + f"\ntimed out after {timeout:.0f} s", True
    merged: dict = {}
    for line in out.splitlines():
        if line.startswith("{"):
            merged.update(json.loads(line))
    if failed and not merged:
        raise RuntimeError(err[-4000:])
    if failed:
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
              compile_: bool = False, cache: Path | None = None, env: dict | None = None,
              profile: bool = False, flops: float | None = None) -> dict:
    """One config's step on the device (batch None: the config's). `profile`: then `steps` more
    steps under torch.profiler (profile_summary), after the timing. A compiled step takes its
    FLOPs from the eager one (`flops`). Beside the measured peak memory, `make plan`'s."""
    s = ctx["sizes"]
    base = [f"data.cache={cache or make_cache(ctx)}", f"runs_dir={ctx['work'] / 'runs'}", f"name=bench_{name}",
            f"device={s.device}", "precision=bf16", "data.workers=0", "wandb.enabled=false", "data.stride=[1,1,1]",
            "data.resident=never", shape_arg(crop)]
    over = base + overrides + ([f"batch_size={batch}"] if batch else []) + [f"compile={'true' if compile_ else 'false'}"]
    r = run_json(_STEP_CODE.format(config=config_path, overrides=over, steps=steps, profile=profile),
                 timeout=time_limit(ctx), env=env)
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


def variants(ctx: dict, section: str, todo: dict, run) -> dict:
    """Run `todo`'s variants in order (name -> (..., seconds of budget needed)), each only with
    the budget it needs left, writing the results after each; a failed variant is recorded and
    the next one still runs."""
    out = {}
    for name, spec in todo.items():
        left = ctx["left"]() if spec[-1] else None
        if spec[-1] and left < spec[-1]:
            out[name] = {"skipped": f"{spec[-1]:.0f} s of budget needed, {left:.0f} s left"}
            continue
        try:
            out[name] = run(name, spec, out)
        except Exception as exc:  # noqa: BLE001 - one variant's failure (an out-of-memory, say) is reported
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[-1500:]}
        write_results(ctx, section, out)
    return out


def production(ctx: dict) -> dict:
    """The ViT-B production step at its config's batch: eager, compiled, cuDNN attention first, and
    the predictor at head dim 64, each profiled."""
    s = ctx["sizes"]

    def one(name, spec, done):
        over, env, compiled, _ = spec
        eager = done.get("eager", {})
        return step_size(ctx, f"production_{name}", PRODUCTION, s.production + over, s.crop, s.batch, s.steps,
                         compile_=compiled, env=env, profile=True,
                         flops=eager.get("flops_per_step") if not over else None)

    return variants(ctx, "production", s.production_variants(), one)


def reference(ctx: dict) -> dict:
    from bench import reference_bench

    src = ctx["vjepa2"]
    if not src or not Path(src).exists():
        return {"skipped": f"no vjepa2 checkout at {src} (make wheelhouse VJEPA2_SRC=<checkout> copies one there)"}
    reference_bench.check_checkout(src)
    s = ctx["sizes"]
    batch = 2 if s.dry else 8  # both steps at the production crop without the stem and local term: vjepa2's work
    base = [f"data.cache={make_cache(ctx)}", f"runs_dir={ctx['work'] / 'runs'}", f"device={s.device}",
            "data.workers=0", "wandb.enabled=false", "data.resident=never", f"batch_size={batch}",
            shape_arg(s.crop), *NO_STEM, *(TINY if s.dry else [])]
    contenders = {"octfm bf16": ["precision=bf16"]}
    if ctx["left"]() > s.seconds(200):
        contenders["octfm bf16 compiled"] = ["precision=bf16", "compile=true"]
    shim = reference_bench.timm_shim(ctx["work"])
    res = reference_bench.measure_steps(src, shim, PRODUCTION, base, device=s.device, variants=contenders,
                                        references={"vjepa2 bf16": True}, warmup=2 if s.dry else 3,
                                        rounds=2 if s.dry else 5, steps=2 if s.dry else 5)
    size = (f"{'tiny (dry run)' if s.dry else 'ViT-B (configs/pretrain_multi_domain.yaml, no stem, no local term)'}, "
            f"{'x'.join(map(str, s.crop))}, batch {batch}")
    res, lines = reference_bench.summarise(res, src, shim, size, precision="bf16")
    res["markdown"] = lines
    return res


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


def check_step(ctx: dict) -> dict:
    """The GPU-size learning check's pretraining step at its batch (256), eager and compiled, each
    profiled, with what the check's `max_steps` x `batch_size` samples take at that step."""
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

    return variants(ctx, "check", {"eager": (False, 0), "compiled": (True, s.seconds(120))}, one)


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
    r = subprocess.run(args, capture_output=True, text=True, timeout=time_limit(ctx))
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-4000:])
    recs = [json.loads(x) for x in (run / "device_run" / "metrics.jsonl").read_text().splitlines()]
    start = next((x for x in recs if x.get("split") == "startup"), {})
    recs = [x for x in recs if x.get("split") == "train"][1:]  # after the first interval (warm-up)
    return {"workers": data.loader_workers(None), "steps": steps, "run_s": time.perf_counter() - t,
            "startup_s": start.get("total_s"), "data_wait_frac": statistics.mean(x["data_wait_frac"] for x in recs),
            "run_samples_per_s": statistics.mean(x["samples_per_s"] for x in recs),
            "batch": s.batch or config.load(TrainConfig, PRODUCTION).batch_size}


SECTIONS: dict[str, Callable[[dict], dict]] = {"environment": environment, "production": production,
                                               "reference": reference, "check": check_step, "run": real_run,
                                               "cuda_tests": cuda_tests}


# ----------------------------------------------------------------------------- report
def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def write_results(ctx: dict, name: str | None = None, partial: dict | None = None) -> None:
    if name is not None:
        ctx["results"][name] = partial
    (ctx["out"] / "device_check.json").write_text(json.dumps(ctx["results"], indent=2, default=str))
    (ctx["out"] / "device_check.md").write_text("\n".join(markdown(ctx["results"])) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make device-check", description=__doc__)
    ap.add_argument("--out", required=True, help="folder for device_check.json and .md")
    ap.add_argument("--dry-run", action="store_true", help="the same code on the CPU at tiny sizes")
    ap.add_argument("--vjepa2", default=".device/vjepa2", help="a facebookresearch/vjepa2 checkout (src/, app/)")
    ap.add_argument("--budget-s", type=float, default=480,
                    help="seconds; each section and variant after the production step's eager one starts only "
                         "with the time it needs left (SECTION_NEEDS, Sizes.production_variants)")
    ap.add_argument("--only", action="append", choices=sorted(SECTIONS))
    ap.add_argument("--work", default=None, help="scratch folder (default: OUT/work, removed at the end)")
    a = ap.parse_args(argv)
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        raise cli.UsageError("make device-check: no CUDA device here (use --dry-run for the CPU rehearsal)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work) if a.work else out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    ctx = {"out": out, "work": work, "sizes": Sizes(a.dry_run), "vjepa2": a.vjepa2,
           "left": lambda: a.budget_s - (time.perf_counter() - t0),
           "results": {"dry_run": a.dry_run, "when": time.strftime("%Y-%m-%d %H:%M:%S")}}
    names = ["environment"] + [n for n in SECTIONS if n != "environment" and (not a.only or n in a.only)]
    for name in names:
        ts = time.perf_counter()
        need = ctx["sizes"].seconds(SECTION_NEEDS.get(name, 0))
        if need and ctx["left"]() < need:
            print(f"device-check: {name} skipped ({need:.0f} s of budget needed, {ctx['left']():.0f} s left)", flush=True)
            write_results(ctx, name, {"skipped": f"{need:.0f} s of budget needed, {ctx['left']():.0f} s left"})
            continue
        print(f"device-check: {name} ...", flush=True)
        try:
            res = SECTIONS[name](ctx)
        except Exception as exc:  # noqa: BLE001 - one section's failure is reported; the others still run
            traceback.print_exc()
            res = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
        res["section_s"] = round(time.perf_counter() - ts, 1)
        ctx["results"]["total_s"] = time.perf_counter() - t0
        write_results(ctx, name, res)
    shutil.rmtree(work, ignore_errors=True)
    print("\n".join(markdown(ctx["results"])))
    print(f"device-check: wrote {out / 'device_check.json'} and {out / 'device_check.md'}")
    return 0


if __name__ == "__main__":
    cli.run(main)
