"""What compiling the production ViT-B step costs, measured on the CPU without its FLOPs.

`python -m bench.compile_cost [--out FILE.json]` (a few minutes on 2 cores; `uptime`'s load is
recorded beside the numbers, since other work may share the machine).

A lent GPU call has about ten minutes, and a cold inductor build of the whole step was guessed
at 2-4 of them. This measures the part of a compile that does not depend on the device, on the
CPU, at the production shapes (configs/pretrain_multi_domain.yaml: ViT-B, 64 x 384 x 384, batch
16, bf16 autocast, attention routed as on CUDA):

- dynamo's trace and AOTAutograd's joint forward/backward trace and min-cut partition (with
  inductor's decompositions), through a backend that stops there: the inputs are fakes inside
  the trace, so no ViT-B arithmetic runs. Two ways: the whole step as `compile: true` compiles it
  (the target encoder's no-grad graph and the student's forward + backward), and each
  transformer block compiled on its own (`Block.compile(dynamic=False)`): dynamo reuses one
  block's code for every block with the same input signature, so a step compiles one graph per
  distinct signature (`block_calls`: five here), not 48 blocks' worth of graph;
- `reuse`: a real tiny step with every block compiled, counting dynamo's graphs, which holds
  that reuse (and stays under dynamo's recompile limit);
- `inductor`: one block at the production width, cold inductor (the CPU back end: C++ built by
  the system compiler) against its own front end, with inductor's phase times. Recorded, not
  used as the GPU's multiplier: there the back end is Triton's codegen and compile, in parallel
  on 16 cores; device_check assumes a multiplier (GPU_ASSUMED["backend_x"]) until its compiled
  variant's first step measures one.

The step's FLOPs (torch's FlopCounterMode on fakes, forward and backward) come out too: what
device_check's predicted step times divide by an assumed GPU rate. The numbers feed
device_check.CPU_MEASURED (by hand: a person reads them beside the load; docs/accelerators.md,
section 10).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import card_batch
from train import plan
from bench.device_report import PRODUCTION


def uptime() -> str:
    """The load beside a timing (other work on the machine slows it)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def route_as_cuda() -> None:
    """`attend` takes the CUDA route (SDPA's fused kernels), so the traced graph is CUDA's."""
    from train import attention

    attention.kernel_for = lambda *a: attention.SDPA_FUSED
    attention.use_fused_kernels()


def production_step(config_path: str = PRODUCTION, overrides: list[str] | None = None):
    """(config, token grid, calibrated mask sizes) of a pretraining config."""
    from octfm import config
    from train import masks
    from train.config import TrainConfig

    cfg = config.load(TrainConfig, config_path, overrides or [])
    grid = masks.grid_for(cfg.data.input_shape, cfg.model.tubelet)
    return cfg, grid, masks.calibrate(grid, cfg.mask, seed=cfg.seed)


def models(cfg):
    """The student and the target encoder, built for real (their init reads values), on the CPU."""
    from train.model import JEPA, Encoder

    torch.manual_seed(0)
    target = Encoder(cfg.model, cfg.data.input_shape).requires_grad_(False)
    return JEPA(cfg.model, cfg.data.input_shape, cfg.loss), target


def step_inputs(cfg, grid, sizes, batch: int):
    """A batch as the step sees it: uint8 volumes, augmentation, each mask set's ids."""
    x = torch.randint(0, 256, (batch, 1, *cfg.data.input_shape), dtype=torch.uint8)
    aug = torch.tensor([[1.0, 0.0]] * batch)
    pairs = [(torch.randint(0, grid.tokens, (batch, s.context_cells * grid.depth), dtype=torch.int32),
              torch.randint(0, grid.tokens, (batch, s.target_cells * grid.depth), dtype=torch.int32))
             for s in sizes]
    return x, aug, pairs


def eager_step(student, target, x, aug, pairs):
    """The update's forward and backward as Trainer.update runs them (no optimizer)."""
    from train import data
    from train.model import target_features

    xn = data.normalize(x, aug)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        targets = target_features(target, xn)
        loss = student(xn, pairs, targets)
    loss.backward()
    return loss


def block_calls(cfg, grid, sizes) -> dict:
    """signature -> calls per step, for every transformer block call of one step, from an eager
    step on fake tensors. A signature is what a compiled block's guards tell apart: the input's
    shape and dtype, grad mode and whether the input needs a grad."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from train.model import Block

    student, target = models(cfg)
    seen = collections.Counter()

    def hook(mod, args):
        (x,) = args
        seen[(tuple(x.shape), str(x.dtype).removeprefix("torch."), mod.attn.heads, torch.is_grad_enabled(),
              x.requires_grad)] += 1

    for m in [*student.modules(), *target.modules()]:
        if isinstance(m, Block):
            m.register_forward_pre_hook(hook)
    with FakeTensorMode(allow_non_fake_inputs=True):
        eager_step(student, target, *step_inputs(cfg, grid, sizes, card_batch(cfg)))
    return dict(seen)


# ----------------------------------------------------------------------------- the front end
class Stop(Exception):
    """Raised by the measuring backend once AOTAutograd has traced and partitioned the graph."""


def front_end_backend(record: dict):
    """A torch.compile backend that runs AOTAutograd as inductor runs it (its decompositions,
    the min-cut partition) with compilers that only count nodes, notes the seconds, and stops:
    nothing is lowered and nothing runs. The backward's compiler is called lazily, at the first
    backward, so its graph is taken from the partition's output here."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    import torch._inductor.lowering  # noqa: F401 - some of inductor's decompositions consult its lowerings
    from torch._inductor.decomposition import select_decomp_table

    def fw(gm, _):
        record["fw_nodes"] = len(gm.graph.nodes)
        return gm

    def bw(gm, _):
        record["bw_nodes"] = len(gm.graph.nodes)
        return gm

    def partition(joint, inputs, **kw):
        fwd, bwd = min_cut_rematerialization_partition(joint, inputs, **kw)
        record["bw_nodes"] = len(bwd.graph.nodes)
        return fwd, bwd

    aot = aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=partition, decompositions=select_decomp_table())

    def backend(gm, example_inputs):
        record["dynamo_nodes"] = len(gm.graph.nodes)
        t = time.perf_counter()
        aot(gm, example_inputs)
        record["aot_s"] = time.perf_counter() - t
        raise Stop()

    return backend


def front_end(fn, *args, dynamic=None) -> dict:
    """Seconds of dynamo + AOTAutograd for `torch.compile(fn)(*args)` (fn a module or function):
    total, of which AOTAutograd, and the graphs' node counts."""
    import torch._dynamo

    torch._dynamo.reset()
    record: dict = {}
    t = time.perf_counter()
    try:
        torch.compile(fn, backend=front_end_backend(record), dynamic=dynamic)(*args)
    except Exception as exc:  # the backend's Stop arrives wrapped by dynamo
        cause = exc
        while cause is not None and not isinstance(cause, Stop):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
    finally:
        torch._dynamo.reset()
    if "aot_s" not in record:
        raise RuntimeError("the backend was never called")
    record["total_s"] = time.perf_counter() - t
    record["dynamo_s"] = record["total_s"] - record["aot_s"]
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in record.items()}


def whole_step(cfg, grid, sizes) -> dict:
    """The step as `compile: true` compiles it (train/runtime.py compile_modules): the target encoder
    (a no-grad graph) and the student (forward + backward), each one dynamo graph."""
    from train import data

    student, target = models(cfg)
    x, aug, pairs = step_inputs(cfg, grid, sizes, card_batch(cfg))
    xn = data.normalize(x, aug)
    targets = torch.zeros(card_batch(cfg), grid.tokens, cfg.model.dim)  # the target's output: its value is not read
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        tgt = front_end(target, xn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stu = front_end(student, xn, pairs, targets)
    return {"target": tgt, "student": stu, "total_s": round(tgt["total_s"] + stu["total_s"], 2)}


def per_block(signatures: dict, mlp_ratio: float) -> dict:
    """Each distinct block signature compiled once (`Block.compile(dynamic=False)`, as
    device_check's compiled variant does): every other block with that signature reuses it."""
    from train.model import Block

    out = {}
    for sig in signatures:
        shape, dtype, heads, grad, needs_grad = sig
        blk = Block(shape[-1], heads, mlp_ratio)
        x = torch.zeros(shape, dtype=getattr(torch, dtype), requires_grad=needs_grad)
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            out[str(sig)] = front_end(blk, x, dynamic=False)
    return {"graphs": out, "total_s": round(sum(r["total_s"] for r in out.values()), 2)}


def reuse() -> dict:
    """A real step of a tiny model of the production config's structure with every block
    compiled on its own: dynamo's graphs against the distinct block signatures (one graph each
    means the blocks share compiled code) and its recompile limit (beyond it a block runs eager)."""
    import torch._dynamo

    from train.model import Block

    cfg, grid, sizes = production_step(overrides=["model.dim=32", "model.heads=2", "model.pred_dim=16", "model.pred_heads=2",
                                             "data.input_shape=[16,128,128]"])
    signatures = block_calls(cfg, grid, sizes)
    student, target = models(cfg)
    graphs = []

    def counting(gm, _):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    for m in [*student.modules(), *target.modules()]:
        if isinstance(m, Block):
            m.compile(backend=counting, dynamic=False)
    eager_step(student, target, *step_inputs(cfg, grid, sizes, 1))
    torch._dynamo.reset()
    return {"block_calls": sum(signatures.values()), "signatures": len(signatures), "dynamo_graphs": len(graphs),
            "recompile_limit": torch._dynamo.config.recompile_limit}


_INDUCTOR = r"""
import json, time, torch
from torch._dynamo.utils import compilation_time_metrics
from bench.compile_cost import front_end, route_as_cuda, warm_up
from train.model import Block
route_as_cuda()
warm_up()
blk = Block({dim}, {heads}, 4.0)
x = torch.randn({shape}, dtype=torch.bfloat16, requires_grad=True)
def step(m):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x).float().sum().backward()
with torch.autocast("cpu", dtype=torch.bfloat16):
    fe = front_end(blk, x, dynamic=False)
step(blk)
t = time.perf_counter(); step(blk); eager = time.perf_counter() - t
compilation_time_metrics.clear()
c = torch.compile(blk, dynamic=False)
t = time.perf_counter(); step(c); first = time.perf_counter() - t
phase = {{k: round(sum(v), 2) for k, v in compilation_time_metrics.items()}}
print(json.dumps({{"front_end_s": fe["total_s"], "inductor_s": round(first - eager, 2),
                  "lowering_s": phase.get("GraphLowering.run"), "scheduler_codegen_s": phase.get("Scheduler.codegen"),
                  "kernel_compile_wait_s": phase.get("async_compile.wait")}}))
"""


def inductor(dim: int = 768, heads: int = 12, tokens: int = 768) -> dict:
    """One block's cold inductor compile (fresh cache, the CPU back end: C++ kernels built by the
    system compiler), forward and backward, in a fresh process, against its front end's seconds,
    with inductor's own phase times. Why its ratio is not the GPU's: docs/accelerators.md."""
    with tempfile.TemporaryDirectory(prefix="octfm-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
               "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
        code = _INDUCTOR.format(dim=dim, heads=heads, shape=(1, tokens, dim))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["ratio"] = round(out["inductor_s"] / out["front_end_s"], 1)
    return out


def warm_up() -> float:
    """dynamo's and AOTAutograd's one-time costs (imports, first fake mode) on a tiny block, so
    the measurements after it are of the graphs; returns its seconds (a fresh process pays them)."""
    from train.model import Block

    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        front_end(Block(16, 2, 4.0), torch.zeros(1, 8, 16, requires_grad=True), dynamic=False)
    return round(time.perf_counter() - t, 2)


def summary_lines(res: dict) -> list[str]:
    """The measurements as a markdown table (docs/accelerators.md takes it)."""
    def row(name: str, graphs: list[dict]) -> str:
        total = lambda k: sum(g[k] for g in graphs)  # noqa: E731
        return (f"| {name} | {len(graphs)} | {total('dynamo_nodes')} | {total('dynamo_s'):.1f} | {total('aot_s'):.1f} | "
                f"{total('total_s'):.1f} |")

    w, b = res["whole_step"], res["per_block"]
    return [f"torch {res['torch']}, {res['cpus']} CPUs; load before: `{res['load_before']}`, after: "
            f"`{res['load_after']}`; one-time first use {res['first_use_s']} s (a fresh process pays it once)", "",
            "| compiled | graphs | dynamo nodes | dynamo (s) | AOTAutograd (s) | front end (s) |",
            "|---|---|---|---|---|---|",
            row("whole step (`compile: true`)", [w["target"], w["student"]]),
            row("per block (`Block.compile(dynamic=False)`)", list(b["graphs"].values()))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compile_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here too")
    ap.add_argument("--skip-inductor", action="store_true", help="leave out the cold inductor block (about a minute)")
    a = ap.parse_args(argv)
    route_as_cuda()
    res = {"torch": torch.__version__, "cpus": len(os.sched_getaffinity(0)), "load_before": uptime()}
    cfg, grid, sizes = production_step()
    res["tokens"], res["batch"] = grid.tokens, card_batch(cfg)
    res["first_use_s"] = warm_up()
    t = time.perf_counter()
    sig = block_calls(cfg, grid, sizes)
    res["block_signatures"] = {str(k): v for k, v in sig.items()}
    res["fake_step_s"] = round(time.perf_counter() - t, 2)
    res["step_tflops"] = round(plan.step_flops(cfg) * card_batch(cfg) / 1e12, 2)  # attention counted (train/plan.py)
    res["whole_step"] = whole_step(cfg, grid, sizes)
    res["per_block"] = per_block(sig, cfg.model.mlp_ratio)
    res["reuse"] = reuse()
    if not a.skip_inductor:
        res["inductor"] = inductor()
    res["load_after"] = uptime()
    text = json.dumps(res, indent=2)
    print(text)
    print("\n".join(summary_lines(res)))
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
