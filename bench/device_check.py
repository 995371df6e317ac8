"""`make device-check OUT=<folder>`: the GPU path measured in one call on a lent H100/H200.

Run on the device machine (python3 with PyTorch and CUDA; the packages its image lacks come as
wheels from `make wheelhouse`, installed by the Makefile into a temporary site folder, no
network). In a few minutes from a bare machine it writes `device_check.json` and
`device_check.md` into OUT (after every section, so a run cut short keeps what it measured):

- environment: the card, torch and CUDA, the measured bf16 matmul rate beside the datasheet's;
- cuda tests: `pytest -m cuda` (tests/test_cuda.py);
- train: the smoke, ViT-S and ViT-B (production) steps in bf16: ms per step, tokens/s, model FLOPs
  per step (torch.utils.flop_counter), MFU against the card's bf16 peak, peak memory; ViT-B at the
  largest batch `make plan` says fits (halved on an out-of-memory);
- check: the GPU-size learning check's pretraining step (configs/pretrain_check_gpu.yaml at its
  batch, 256; eager, eager at twice the batch, compiled, eager with cuDNN attention allowed), each
  profiled, and what the check's 1,850 x 256 samples take at it;
- reference: octfm's step beside facebookresearch/vjepa2's at equal work (bench/reference_bench.py),
  from a checkout carried in .device/vjepa2 (`make wheelhouse VJEPA2_SRC=...`);
- loader: the production loader with the default workers at the production crop, volumes per second
  against what the ViT-B step consumes, and the data-wait share of a real `make pretrain` run.

`--dry-run` runs the same code on the CPU at tiny sizes (make test runs it, so it cannot rot).
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

from bench import verdict
from octfm import cli

PRODUCTION = "configs/pretrain_multi_domain.yaml"
SMOKE = "configs/pretrain_smoke.yaml"
CHECK = "configs/pretrain_check_gpu.yaml"  # the learning check at GPU size (make learning-check-device)
MFU_TARGET, REFERENCE_TARGET, WAIT_TARGET = 0.40, 1.5, 0.05
CHECK_TARGET_S = 360  # issue 41: the GPU-size learning check from a bare machine
DATASHEET_BF16_TFLOPS = {"h100": 989.0, "h200": 989.0}  # dense, SXM (train/plan.py ACCELERATORS)
VIT_S = ["model.dim=384", "model.depth=12", "model.heads=6", "model.pred_dim=192", "model.pred_depth=6",
         "model.pred_heads=6"]
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
        # name -> (config, overrides, crop, batch or None for the plan's largest, timed steps)
        self.train = {
            "smoke": (SMOKE, [], [32, 96, 96], 4, 20),
            "vit_s": (PRODUCTION, VIT_S, self.crop, None, 10),
            "vit_b": (PRODUCTION, [], self.crop, None, 10),
        }
        if dry:  # one size: the three run the same code
            self.train = {"vit_b": (PRODUCTION, TINY, self.crop, None, 2)}
        # the GPU-size learning check's step (configs/pretrain_check_gpu.yaml): config, overrides, crop, batch, steps
        self.check = (CHECK, TINY if dry else [], [32, 96, 96], 2 if dry else 256, 2 if dry else 10)
        self.check_participants = 12 if dry else 400  # about 640 train volumes: more than a batch of twice 256
        self.batch_cap = 2 if dry else 64
        self.loader_batches = 4 if dry else 30
        self.run_steps = 4 if dry else 40


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
with FlopCounterMode(display=False) as fc:
    tr.update([batches[0]], net)
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
                  "tokens": tr.grid.tokens, "batch": cfg.batch_size, "flops_per_step": fc.get_total_flops(),
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
    """A subprocess's time limit: what the budget leaves, and at least 4 minutes (the check ends)."""
    return max(240.0, ctx["left"]())


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


def plan_batch(config_path: str, overrides: list[str], accel: str | None, cap: int) -> int:
    from octfm import config
    from train import plan
    from train.config import TrainConfig

    cfg = config.load(TrainConfig, config_path, overrides)
    return max(1, min(cap, plan.make_plan(cfg, accel or "h100", 1).largest_batch))


def shape_arg(crop) -> str:
    return "data.input_shape=[" + ",".join(map(str, crop)) + "]"


def step_size(ctx: dict, name: str, config_path: str, overrides: list[str], crop, batch: int, steps: int,
              compile_: bool = False, cache: Path | None = None, env: dict | None = None,
              profile: bool = False) -> dict:
    """One config's step on the device; on an out-of-memory the batch is halved and tried again.
    `profile`: then `steps` more steps under torch.profiler (profile_summary), after the timing."""
    s = ctx["sizes"]
    base = [f"data.cache={cache or make_cache(ctx)}", f"runs_dir={ctx['work'] / 'runs'}", f"name=bench_{name}",
            f"device={s.device}", "precision=bf16", "data.workers=0", "wandb.enabled=false", "data.stride=[1,1,1]",
            shape_arg(crop)]
    while True:
        over = base + overrides + [f"batch_size={batch}", f"compile={'true' if compile_ else 'false'}"]
        try:
            r = run_json(_STEP_CODE.format(config=config_path, overrides=over, steps=steps, profile=profile),
                         timeout=time_limit(ctx),
                         env=env)
            break
        except RuntimeError as exc:
            if "out of memory" not in str(exc).lower() or batch == 1:
                raise
            batch //= 2
    peak = (ctx["env"].get("datasheet_bf16_tflops") or ctx["env"]["matmul_bf16_tflops"]) * 1e12
    r["tokens_per_s"] = r["batch"] * r["tokens"] / r["step_s"]
    r["achieved_tflops"] = r["flops_per_step"] / r["step_s"] / 1e12
    r["mfu"] = r["flops_per_step"] / r["step_s"] / peak
    r["mfu_of_measured_matmul"] = r["flops_per_step"] / r["step_s"] / (ctx["env"]["matmul_bf16_tflops"] * 1e12)
    if r.get("profile_device_ms_per_step") is not None:
        r["gpu_busy_frac"] = r["profile_device_ms_per_step"] / 1e3 / r["step_s"]
    return r


def train_steps(ctx: dict) -> dict:
    s = ctx["sizes"]
    out = {}
    for name, (path, over, crop, batch, steps) in s.train.items():
        b = batch or plan_batch(path, over + [shape_arg(crop)], ctx["env"]["accel"], s.batch_cap)
        out[name] = step_size(ctx, name, path, over, crop, b, steps, profile=name == "vit_b")
        write_results(ctx, "train", out)
    if ctx["left"]() > (60 if s.dry else 150):  # torch.compile of ViT-B takes a minute or more
        path, over, crop, _, steps = s.train["vit_b"]
        out["vit_b_compiled"] = step_size(ctx, "vit_b_compiled", path, over, crop, out["vit_b"]["batch"], steps,
                                          compile_=True)
    ctx["train"] = out
    return out


def reference(ctx: dict) -> dict:
    from bench import reference_bench

    src = ctx["vjepa2"]
    if not src or not Path(src).exists():
        return {"skipped": f"no vjepa2 checkout at {src} (make wheelhouse VJEPA2_SRC=<checkout> copies one there)"}
    reference_bench.check_checkout(src)
    s = ctx["sizes"]
    batch = 2 if s.dry else max(1, ctx.get("train", {}).get("vit_b", {}).get("batch", 8) // 2)
    base = [f"data.cache={make_cache(ctx)}", f"runs_dir={ctx['work'] / 'runs'}", f"device={s.device}",
            "data.workers=0", "wandb.enabled=false", f"batch_size={batch}",
            shape_arg(s.crop), *NO_STEM, *(TINY if s.dry else [])]
    variants = {"octfm bf16": ["precision=bf16"]}
    if not s.dry and ctx["left"]() > 200:
        variants["octfm bf16 compiled"] = ["precision=bf16", "compile=true"]
    shim = reference_bench.timm_shim(ctx["work"])
    res = reference_bench.measure_steps(src, shim, PRODUCTION, base, device=s.device, variants=variants,
                                  references={"vjepa2 bf16": True}, warmup=2 if s.dry else 3,
                                  rounds=2 if s.dry else 5, steps=2 if s.dry else 5)
    size = (f"{'tiny (dry run)' if s.dry else 'ViT-B (configs/pretrain_multi_domain.yaml, no stem, no local term)'}, "
            f"{'x'.join(map(str, s.crop))}, batch {batch}")
    res, lines = reference_bench.summarise(res, src, shim, size, precision="bf16")
    res["markdown"] = lines
    return res


def check_cache(ctx: dict) -> Path:
    """A cache at the GPU-size learning check's shape: a small cohort from its generator config
    through its cache build (evals/learning_check.py)."""
    if "check_cache" not in ctx:
        from evals import learning_check as lc
        from ingest import synth

        src, cache = ctx["work"] / "check_dataset", ctx["work"] / "check_cache"
        synth.generate(src, dataclasses.replace(lc.COHORT, participants=ctx["sizes"].check_participants, seed=0))
        ctx["check_cache"] = Path(lc.build_cache(str(src), cache))
    return ctx["check_cache"]


def check_step(ctx: dict) -> dict:
    """The GPU-size learning check's pretraining step at its batch, eager, then with time left at
    twice the batch (whether a step's cost is per dispatch or per sample: if the host sets the
    pace, a sample costs about half as much), compiled, and eager with cuDNN attention allowed (its
    first step against the default's: the lead for the first H200 run's 97 s, train/attention.py),
    each with what the check's `max_steps` x `batch_size` samples take at that step: the check's
    largest stage (issue 41's six minutes)."""
    from octfm import config
    from train import attention
    from train.config import TrainConfig

    s = ctx["sizes"]
    path, over, crop, batch, steps = s.check
    recipe = config.load(TrainConfig, path)
    samples = recipe.max_steps * recipe.batch_size  # what the check's pretraining trains on
    out = {}
    off, on = {attention.CUDNN_ENV: "0"}, {attention.CUDNN_ENV: "1"}
    # name: (compiled, environment, batch, seconds left it needs: 0 always runs; inductor takes a minute or so)
    variants = {"eager": (False, off, batch, 0), "eager_double_batch": (False, off, 2 * batch, 60),
                "compiled": (True, off, batch, 150), "eager_cudnn_attention": (False, on, batch, 90)}
    for name, (compiled, env, b, needs) in variants.items():
        if needs and ctx["left"]() < (needs / 5 if s.dry else needs):
            continue
        r = step_size(ctx, f"check_{name}", path, over, crop, b, steps, compile_=compiled, cache=check_cache(ctx),
                      env=env, profile=True)
        r["steps_for_the_check"] = -(-samples // r["batch"])  # the same samples as the recipe's steps
        r["pretrain_s"] = r["step_s"] * r["steps_for_the_check"]
        out[name] = r
        write_results(ctx, "check", out)
    return out


def loader(ctx: dict) -> dict:
    """The production loader (default workers, random-resized crop) alone, then a real run."""
    from octfm import config
    from train import data, pretrain, runtime
    from train.config import TrainConfig

    s = ctx["sizes"]
    vit_b = ctx.get("train", {}).get("vit_b", {})
    batch = vit_b.get("batch", 2)
    over = [f"data.cache={make_cache(ctx)}", f"runs_dir={ctx['work'] / 'runs'}", "device=cpu", "precision=fp32",
            f"batch_size={batch}", shape_arg(s.crop), "wandb.enabled=false",
            *(TINY if s.dry else [])]
    cfg = config.load(TrainConfig, PRODUCTION, over)
    workers = data.loader_workers(cfg.data.workers)
    out = {"workers": workers, "batch": batch}
    if not s.dry:  # the loader alone (the dry run keeps to the real run below: a worker's start is seconds on 2 cores)
        tr = pretrain.Trainer(cfg, runtime.setup("cpu", "fp32"))
        _, dl = tr.loader(tr.rows, 0, augment=True, shuffle=True, seed=0)
        it = iter(dl)
        for _ in range(2):
            next(it)
        t = time.perf_counter()
        for _ in range(s.loader_batches):
            next(it)
        out["volumes_per_s"] = s.loader_batches * batch / (time.perf_counter() - t)
        del it, dl
    if vit_b.get("step_s"):
        out["step_consumes_volumes_per_s"] = batch / vit_b["step_s"]
    # a real run of the production config on the device with the default workers
    run = ctx["work"] / "runs"
    args = [sys.executable, "-m", "train.pretrain", "--config", PRODUCTION, "--no-progress", f"device={s.device}",
            f"data.cache={make_cache(ctx)}", f"runs_dir={run}", "name=device_run", f"batch_size={batch}",
            shape_arg(s.crop), f"max_steps={s.run_steps}",
            f"log_every={max(1, s.run_steps // 4)}", "val_every=0", "eval_every=0", f"ckpt_every={s.run_steps}",
            "wandb.enabled=false", *(TINY if s.dry else [])]
    t = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, timeout=time_limit(ctx))
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-4000:])
    recs = [json.loads(x) for x in (run / "device_run" / "metrics.jsonl").read_text().splitlines()]
    recs = [x for x in recs if x.get("split") == "train"][1:]  # after the first interval (compile, warm-up)
    out.update(run_s=time.perf_counter() - t, data_wait_frac=statistics.mean(x["data_wait_frac"] for x in recs),
               run_samples_per_s=statistics.mean(x["samples_per_s"] for x in recs))
    return out


SECTIONS: dict[str, Callable[[dict], dict]] = {"environment": environment, "cuda_tests": cuda_tests, "train": train_steps,
                                               "check": check_step, "reference": reference, "loader": loader}


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


def verdicts(res: dict) -> list[str]:
    env = res.get("environment") or {}
    card = env.get("device", "?")
    lines = []
    tr = res.get("train") or {}
    best = max((v for k, v in tr.items() if k.startswith("vit_b") and isinstance(v, dict) and "mfu" in v),
               key=lambda v: v["mfu"], default=None)
    if best:
        lines.append(f"MFU of the production (ViT-B) step in bf16 at batch {best['batch']}"
                     f"{' compiled' if best.get('compile') else ''}: {100 * best['mfu']:.1f}% of the {card}'s bf16 "
                     f"peak (target >= {100 * MFU_TARGET:.0f}%): {verdict(best['mfu'] >= MFU_TARGET)}")
    else:
        lines.append("MFU: not measured")
    ref = res.get("reference") or {}
    if ref.get("ratio"):
        name, ratio = max(ref["ratio"].items(), key=lambda kv: kv[1])
        lines.append(f"octfm / vjepa2 at equal work ({name}): {ratio:.2f}x (target >= {REFERENCE_TARGET}x): "
                     f"{verdict(ratio >= REFERENCE_TARGET)}")
    else:
        lines.append(f"octfm / vjepa2: not measured ({ref.get('skipped') or ref.get('error') or 'no result'})")
    ld = res.get("loader") or {}
    if "data_wait_frac" in ld:
        w = ld["data_wait_frac"]
        lines.append(f"data wait with the default loader ({ld['workers']} workers): {100 * w:.1f}% of the step "
                     f"(target < {100 * WAIT_TARGET:.0f}%): {verdict(w < WAIT_TARGET)}")
    else:
        lines.append(f"data wait: not measured ({ld.get('error', 'no result')})")
    ck = {k: v for k, v in (res.get("check") or {}).items() if isinstance(v, dict) and "pretrain_s" in v}
    if ck:
        best = min(ck, key=lambda k: ck[k]["pretrain_s"])
        lines.append(f"GPU-size learning check's pretraining at the measured step: "
                     + ", ".join(f"{k} {v['pretrain_s']:.0f} s" for k, v in ck.items())
                     + f"; the pretraining alone inside the whole check's {CHECK_TARGET_S} s from nothing: "
                     + verdict(ck[best]["pretrain_s"] < CHECK_TARGET_S))
    ct = res.get("cuda_tests") or {}
    if "tests" in ct:
        lines.append(f"CUDA tests: {ct['passed']} passed, {len(ct['failed'])} failed {ct['failed'] or ''}, "
                     f"{ct['skipped']} skipped")
    return lines


def step_table(steps: dict, title: str) -> list[str]:
    """A section's measured steps (step_size's records) as a table."""
    rows = {k: v for k, v in steps.items() if isinstance(v, dict) and "step_s" in v}
    if not rows:
        return []
    md = [f"## {title}", "", "| config | params | batch | tokens/sample | step (ms) | tokens/s | GFLOP/step | "
          "achieved TFLOP/s | MFU (datasheet) | MFU (measured matmul) | peak GiB | first step (s) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, v in rows.items():
        md.append(f"| {k} | {v['params_m']:.1f} M | {v['batch']} | {v['tokens']} | {1000 * v['step_s']:.1f} | "
                  f"{v['tokens_per_s']:.0f} | {v['flops_per_step'] / 1e9:.0f} | {v['achieved_tflops']:.1f} | "
                  f"{100 * v['mfu']:.1f}% | {100 * v['mfu_of_measured_matmul']:.1f}% | "
                  f"{'-' if v['peak_gib'] is None else format(v['peak_gib'], '.1f')} | {v['first_step_s']:.1f} |")
    return md + [""]


def profile_table(steps: dict, title: str) -> list[str]:
    """Where the profiled steps' time goes (profile_summary's records)."""
    rows = {k: v for k, v in steps.items()
            if isinstance(v, dict) and any(x in v for x in ("profile_top", "profile_error", "late_error"))}
    if not rows:
        return []
    md = [f"## {title}", ""]
    for k, v in rows.items():
        if "profile_top" not in v:
            why = v.get("profile_error") or (v["late_error"].strip().splitlines() or ["?"])[-1][:300]
            md += [f"{k}: not profiled ({why})", ""]
            continue
        busy = v.get("gpu_busy_frac")
        where = ("" if busy is None else
                 f"kernels {v['profile_device_ms_per_step']:.1f} ms per step against {1000 * v['step_s']:.1f} ms "
                 f"unprofiled: the GPU is busy {100 * busy:.0f}% of a step ({'the host sets the pace' if busy < 0.7 else 'the GPU sets the pace'}); ")
        launches = f", {v['profile_kernels_per_step']:.0f} kernel launches" if "profile_kernels_per_step" in v else ""
        md += [f"{k}: {where}host time in ops and runtime calls (its waits left out) {v['profile_host_ms_per_step']:.1f} ms "
               f"per step, {v['profile_op_calls_per_step']:.0f} aten op calls{launches} per step.", "",
               f"| {'kernel' if busy is not None else 'op'} | {'device' if busy is not None else 'host'} ms per step | "
               "calls per step |", "|---|---|---|",
               *(f"| `{name}` | {ms:.2f} | {n:g} |" for name, ms, n in v["profile_top"]), ""]
    return md


def markdown(res: dict) -> list[str]:
    env = res.get("environment") or {}
    md = [f"# make device-check: {env.get('device', '?')}{' (DRY RUN: CPU, tiny sizes)' if res.get('dry_run') else ''}",
          "", f"torch {env.get('torch')}, CUDA {env.get('cuda')}, {env.get('cpus')} CPUs; bf16 matmul measured "
              f"{env.get('matmul_bf16_tflops', 0):.1f} TFLOP/s (datasheet {env.get('datasheet_bf16_tflops')}); "
              f"torch built for {','.join(env.get('arch_list') or []) or '-'}; "
              f"{res.get('when')}; total {res.get('total_s', 0):.0f} s", ""]
    for key, title in (("train", "Training step (bf16)"),
                       ("check", f"The GPU-size learning check's pretraining step ({CHECK}, bf16)")):
        md += step_table(res.get(key) or {}, title)
        md += profile_table(res.get(key) or {}, f"{title}: where a step's time goes (torch.profiler)")
    ref = res.get("reference") or {}
    if ref.get("markdown"):
        md += ref["markdown"] + [""]
    ld = res.get("loader") or {}
    if "data_wait_frac" in ld:
        md += ["## Loader (production crop, random-resized crop, default workers)", "",
               f"{ld['workers']} workers: {ld.get('volumes_per_s', float('nan')):.1f} volumes/s alone; the ViT-B step "
               f"consumes {ld.get('step_consumes_volumes_per_s', float('nan')):.1f} volumes/s at batch {ld['batch']}. A real run "
               f"({ld.get('run_s', 0):.0f} s): data wait {100 * ld.get('data_wait_frac', float('nan')):.1f}% of the step, "
               f"{ld.get('run_samples_per_s', float('nan')):.1f} samples/s.", ""]
    for name, v in res.items():
        if isinstance(v, dict) and v.get("error"):
            md += [f"Section {name} failed: `{v['error'][:300]}`", ""]
    md += ["## Verdicts", "", *(f"- {v}" for v in verdicts(res))]
    return md


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make device-check", description=__doc__)
    ap.add_argument("--out", required=True, help="folder for device_check.json and .md")
    ap.add_argument("--dry-run", action="store_true", help="the same code on the CPU at tiny sizes")
    ap.add_argument("--vjepa2", default=".device/vjepa2", help="a facebookresearch/vjepa2 checkout (src/, app/)")
    ap.add_argument("--budget-s", type=float, default=330,
                    help="seconds; optional parts (compiled steps) start only with enough of it left")
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
