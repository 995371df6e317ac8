"""What make device-check (bench/device_check.py) measures of training steps on the device: a config's
step in a fresh process (ms per step, FLOPs, MFU, the GPU's busy share, the peak memory beside `make
plan`'s), the production step's variants, the GPU-size check's step, octfm beside vjepa2 at equal work, the
stem's convolution with cuDNN's benchmark off and on, and a real `make pretrain` with its data wait; and
the caches they train on.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import card_batch
from bench.device_budget import CapReached, Item, remaining, variants
from bench.device_report import PRODUCTION
from bench.recipe_bench import PLAIN

TINY = ["model.dim=32", "model.depth=2", "model.heads=2", "model.pred_dim=16", "model.pred_depth=1",
        "model.pred_heads=2"]


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
_, dl = tr.train_loader(0)
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
                  "tokens": tr.grid.tokens, "batch": cfg.global_batch, "flops_per_step": flops,
                  "peak_gib": peak, "params_m": sum(p.numel() for p in tr.model.parameters()) / 1e6,
                  "compile": "per block" if blocks else cfg.compile}}), flush=True)  # the timing is kept if the profiling below fails
if {profile}:
    try:
        from bench.device_steps import profile_summary
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


def config_card_batch(config_path: str) -> int:
    """A card's batch of a pretraining config in the GPU recipe (bench.card_batch)."""
    from octfm import config
    from train.config import TrainConfig

    return card_batch(config.load(TrainConfig, config_path))


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
    over = base + overrides + [f"global_batch={batch or config_card_batch(config_path)}", f"compile={whole}"]
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


def check_step(ctx: dict, items: dict[str, Item]) -> dict:
    """The GPU-size learning check's pretraining step at its batch (256), `items`' variants (eager;
    compiled, each block on its own), each profiled, with what the check's `max_steps` x
    `global_batch` samples take at that step."""
    from octfm import config
    from train.config import TrainConfig

    s = ctx["sizes"]
    path, over, crop, batch, steps = s.check
    recipe = config.load(TrainConfig, path)
    samples = recipe.max_steps * recipe.global_batch  # what the check's pretraining trains on

    def one(name, spec, done):
        r = step_size(ctx, f"check_{name}", path, over, crop, batch, steps, compile_=spec[0], cache=check_cache(ctx),
                      profile=True, flops=done.get("eager", {}).get("flops_per_step"))
        r["steps_for_the_check"] = -(-samples // r["batch"])  # the same samples as the recipe's steps
        r["pretrain_s"] = r["step_s"] * r["steps_for_the_check"]
        return r

    modes = {"eager": None, "compiled": "blocks"}
    return variants(ctx, "check", {k: (modes[k], it) for k, it in items.items()}, one)


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
            "data.workers=0", "wandb.enabled=false", "data.resident=never", f"global_batch={batch}",
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
    batch = s.batch or config_card_batch(PRODUCTION)
    r = run_json(_STEM_CODE.format(config=PRODUCTION, overrides=s.production, device=s.device, batch=batch,
                                   crop=s.crop, steps=s.steps), timeout=remaining(ctx))
    if "on" in r:
        r["off_over_on"] = r["off"]["step_ms"] / r["on"]["step_ms"]
    return r


def real_run(ctx: dict) -> dict:
    """A real `make pretrain` of the production config on the device, on a cache of the production
    shape, with the default loader workers and the volumes read from disk (data.resident=never: a
    real AI-READI cache is far larger than the card), for its data-wait share after the first interval."""
    from train import data

    s = ctx["sizes"]
    run = ctx["work"] / "runs"
    steps = s.run_steps
    args = [sys.executable, "-m", "train.pretrain", "--config", PRODUCTION, "--no-progress", f"device={s.device}",
            f"data.cache={make_cache(ctx)}", f"runs_dir={run}", "name=device_run", "data.resident=never",
            shape_arg(s.crop), f"max_steps={steps}", f"log_every={max(1, steps // 10)}", "val_every=0", "eval_every=0",
            f"ckpt_every={steps}", "wandb.enabled=false", *s.production,
            f"global_batch={s.batch or config_card_batch(PRODUCTION)}"]
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
            "batch": s.batch or config_card_batch(PRODUCTION)}
