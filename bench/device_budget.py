"""make device-check's budget (bench/device_check.py): what each item is predicted to cost on the lent GPU
(CPU_MEASURED, GPU_ASSUMED), which items a budget buys, and each item run under its rules: started only
when its prediction fits in what is left, stopped at its cap or the budget's end, a failure recorded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
import traceback
from typing import Callable, Sequence

from bench.device_report import write_results


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


# ----------------------------------------------------------------------------- an item under the budget
def remaining(ctx: dict) -> float | None:
    """A subprocess's time limit: what the running item's limit leaves, less two seconds, so the
    subprocess is stopped (keeping what it printed) before the item's alarm rings (None: no limit)."""
    deadline = ctx.get("deadline")
    return None if deadline is None else max(1.0, deadline - time.monotonic() - 2.0)


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
