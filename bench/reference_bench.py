"""octfm's training step beside the facebookresearch/vjepa2 step at equal work.

Set VJEPA2_SRC to a checkout of facebookresearch/vjepa2 (outside this repository); its modules
are imported from there (VisionTransformer, VisionTransformerPredictor, the multi-mask wrappers,
`init_opt`, `apply_masks`) and none of its code is copied. Both steps run in one process on the
same batches and the SAME context and target token ids (octfm's masks), so the encoder, the
predictor and the loss see equal token counts: the ratio is implementation, not masking.

The reference step is the sequence of vjepa2's app/vjepa/train.py: target forward with a
layer norm, context encoder, predictor, L1 on the target tokens, backward, AdamW (its own
`init_opt` groups, default AdamW flags), zero_grad, and the EMA with foreach mul/add.
Rounds alternate the contenders (each warmed up; median over rounds), so drift hits all alike.
With a deadline (a lent GPU's call, bench/device_check.py) the measuring stops when it passes, at
a round's end, and the rounds done by then are the result; the results so far are printed after
every round, so a process stopped from outside keeps them too.

vjepa2 imports timm for one function (`drop_path`, unused at drop-path rate 0) and timm imports
torchvision; where no torchvision matches this torch (the CPU build), a stand-in `timm` package
whose `drop_path` raises is put on the path, and the results say so.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import verdict
from bench.recipe_bench import PLAIN
from bench.train_bench import CPU, SMOKE, VITS, _make_cache

TARGET = 1.5  # octfm's step at least 1.5x the reference's at equal work
# contenders: octfm's (name -> overrides on the ViT-S config) and the reference's (name -> bf16 autocast);
# a ratio is taken against the reference of the same precision
VARIANTS = {"octfm fp32": [], "octfm fp32 compiled": ["compile=true"], "octfm bf16": ["precision=bf16"]}
REFERENCES = {"vjepa2 fp32": False, "vjepa2 bf16": True}

_TIMM_SHIM = '''"""Stand-in for timm (octfm bench): vjepa2 imports timm.models.layers.drop_path, which its
blocks call only at a drop-path rate above 0; the bench runs at rate 0."""
'''
_TIMM_LAYERS = '''def drop_path(*args, **kwargs):
    raise RuntimeError("octfm bench: the timm stand-in has no drop_path; run the reference at drop-path rate 0")
'''

_CODE = r"""
import copy, json, statistics, sys, time
sys.path.insert(0, {src!r})
if {shim!r}:
    sys.path.insert(0, {shim!r})
import torch
import torch.nn.functional as F
from octfm import config
from train import pretrain, runtime
from train.config import TrainConfig
from src.models.vision_transformer import VisionTransformer
from src.models.predictor import VisionTransformerPredictor
from src.utils.wrappers import MultiSeqWrapper, PredictorMultiSeqWrapper
from src.masks.utils import apply_masks
from app.vjepa.utils import init_opt

variants = {variants!r}
trainers = {{}}
for name, extra in variants.items():
    cfg = config.load(TrainConfig, {config!r}, {overrides!r} + extra)
    trainers[name] = pretrain.Trainer(cfg, runtime.setup({device!r}, cfg.precision))
tr = next(iter(trainers.values()))
cfg = tr.cfg
_, dl = tr.train_loader(0)
it = iter(dl)
batches = [tr.rt.to_device(next(it)) for _ in range(4)]
for t in trainers.values():
    t.lr.fill_(1e-4); t.momentum.fill_(0.99)

m = cfg.model
d, h, w = cfg.data.input_shape
assert h == w and m.tubelet[1] == m.tubelet[2] and not m.stem, "the reference needs square patches and no stem"

def make_ref(bf16):
    enc = MultiSeqWrapper(VisionTransformer(img_size=(h, w), patch_size=m.tubelet[1], num_frames=d, tubelet_size=m.tubelet[0],
                                            in_chans=1, embed_dim=m.dim, depth=m.depth, num_heads=m.heads,
                                            mlp_ratio=m.mlp_ratio, use_sdpa=True, use_rope={rope!r}))
    pred = PredictorMultiSeqWrapper(VisionTransformerPredictor(
        img_size=(h, w), patch_size=m.tubelet[1], num_frames=d, tubelet_size=m.tubelet[0], embed_dim=m.dim,
        predictor_embed_dim=m.pred_dim, depth=m.pred_depth, num_heads=m.pred_heads, mlp_ratio=m.mlp_ratio,
        use_mask_tokens=True, num_mask_tokens=len(cfg.mask.sets), use_sdpa=True, use_rope={rope!r}))
    enc, pred = enc.to(tr.rt.device), pred.to(tr.rt.device)
    target = copy.deepcopy(enc)
    for p in target.parameters():
        p.requires_grad = False
    opt, _, sched, wd_sched = init_opt(False, enc, pred, iterations_per_epoch=1000, start_lr=1e-4, ref_lr=1e-4, warmup=1,
                                       num_epochs=10, wd=cfg.optim.weight_decay, final_wd=cfg.optim.weight_decay,
                                       mixed_precision=bf16)

    def step(b):
        # vjepa2's app/vjepa/train.py train_step, in its order, on octfm's batch and masks (bf16: CPU autocast
        # around the forward, where its CUDA run has torch.cuda.amp.autocast; bf16 needs no loss scaling)
        x = pretrain.data.normalize(b["x"], b["aug"])
        n = sum(1 for k in b if k.startswith("ctx_"))
        m_enc = [[b[f"ctx_{{i}}"].long() for i in range(n)]]  # vjepa2 gathers with int64 ids (octfm's are int32)
        m_pred = [[b[f"tgt_{{i}}"].long() for i in range(n)]]
        sched.step(); wd_sched.step()
        with torch.autocast(tr.rt.device.type, dtype=torch.bfloat16, enabled=bf16):
            with torch.no_grad():
                hh = [F.layer_norm(hi, (hi.size(-1),)) for hi in target([x])]
            z = pred(enc([x], m_enc), m_enc, m_pred)
            hh = [apply_masks(hi, mi, concat=False) for hi, mi in zip(hh, m_pred)]
            loss, k = 0, 0
            for zi, hi in zip(z, hh):
                for zij, hij in zip(zi, hi):
                    loss += torch.mean(torch.abs(zij - hij)); k += 1
            loss = loss / k
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            pk = list(target.parameters()); pq = list(enc.parameters())
            torch._foreach_mul_(pk, 0.99)
            torch._foreach_add_(pk, pq, alpha=0.01)
        return float(loss)
    params = sum(p.numel() for p in enc.parameters()) + sum(p.numel() for p in pred.parameters())
    return step, params

nets = {{name: t.network() for name, t in trainers.items()}}  # compiled in place where the variant says so
steps = {{name: (lambda b, t=t, n=nets[name]: float(t.update([b], n)[0])) for name, t in trainers.items()}}
for name, bf16 in {references!r}.items():
    steps[name], ref_params = make_ref(bf16)
deadline = {deadline!r}  # time.time() by which to stop measuring (None: never)
warm = {{}}
times = {{name: [] for name in steps}}
ctx = [int(v.shape[1]) for k, v in batches[0].items() if k.startswith("ctx_")]
tgt = [int(v.shape[1]) for k, v in batches[0].items() if k.startswith("tgt_")]
def report(stopped=None):
    print(json.dumps({{"device": torch.cuda.get_device_name() if {device!r} == "cuda" else "CPU", "times": times, "warmup_s": warm, "context_tokens": ctx, "target_tokens": tgt,
                      "params_m": {{"octfm": sum(p.numel() for p in tr.model.parameters()) / 1e6,
                                   "vjepa2": ref_params / 1e6}},
                      "torch": torch.__version__, "threads": torch.get_num_threads(), "stopped": stopped}}), flush=True)
def past():
    return deadline is not None and time.time() > deadline
stopped = None
for name, fn in steps.items():  # warm-up (and compilation) outside the timed rounds
    if past():
        stopped = f"the deadline passed in the warm-up, before {{name}}"
        break
    t = time.perf_counter()
    for i in range({warmup}):
        fn(batches[i % len(batches)])
    warm[name] = time.perf_counter() - t
for r in range({rounds}):
    if stopped or past():
        stopped = stopped or f"the deadline passed after {{r}} of {rounds} rounds"
        break
    for name, fn in steps.items():
        t = time.perf_counter()
        for i in range({steps}):
            fn(batches[i % len(batches)])
        times[name].append((time.perf_counter() - t) / {steps})
    report()
report(stopped)
"""


def timm_shim(root: Path) -> str:
    """'' when timm imports here; else a folder holding the stand-in (see the module docstring)."""
    if subprocess.run([sys.executable, "-c", "import timm.models.layers"], capture_output=True).returncode == 0:
        return ""
    pkg = root / "timm_shim" / "timm"
    (pkg / "models").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(_TIMM_SHIM)
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "layers.py").write_text(_TIMM_LAYERS)
    return str(root / "timm_shim")


def _commit(src: str) -> str:
    """The checkout's commit: a copy without git (make wheelhouse's) keeps it in COMMIT; a git
    checkout says it (not the repository around a copy)."""
    marker = Path(src) / "COMMIT"
    if marker.exists():
        return marker.read_text().strip()
    r = subprocess.run(["git", "-C", src, "rev-parse", "--show-toplevel", "--short", "HEAD"], capture_output=True,
                       text=True)
    lines = r.stdout.split()
    if r.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == Path(src).resolve():
        return lines[1]
    return "unknown"


def measure_steps(src: str, shim: str, config: str, overrides: list[str], device: str = "cpu",
                  variants: dict = VARIANTS, references: dict = REFERENCES, warmup: int = 5, rounds: int = 5,
                  steps: int = 8, deadline: float | None = None, kill_after: float = 60.0) -> dict:
    """Both steps in one subprocess at equal work, alternating rounds (see the module docstring).
    `deadline` (time.time()): stop measuring when it passes and return the rounds done, with why
    under `stopped`; the process is killed `kill_after` seconds after it, keeping what it printed."""
    code = _CODE.format(src=str(Path(src).resolve()), shim=shim, variants=variants, references=references,
                        config=config, overrides=overrides, device=device, rope=False, warmup=warmup, rounds=rounds,
                        steps=steps, deadline=deadline)
    timeout = None if deadline is None else max(1.0, deadline - time.time() + kill_after)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
        out, err, failed = r.stdout, r.stderr, r.returncode != 0
    except subprocess.TimeoutExpired as exc:  # killed: what it printed stands; nothing printed, the caller hears
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        if "{" not in out:
            raise
        err, failed = f"killed {timeout:.0f} s after it started, {kill_after:.0f} s past its deadline", True
    printed = [line for line in out.splitlines() if line.startswith("{")]
    if failed and not printed:
        raise RuntimeError(err[-3000:])
    res = json.loads(printed[-1])
    if failed:
        res["stopped"] = (res.get("stopped") or "stopped") + f"; then: {err.strip().splitlines()[-1][:300]}"
    return res


def check_checkout(src: str) -> None:
    if not (Path(src) / "src" / "models" / "vision_transformer.py").exists():
        raise FileNotFoundError(f"{src}: no src/models/vision_transformer.py (not a vjepa2 checkout)")


def run(workdir: Path, quick: bool = False):
    src = os.environ.get("VJEPA2_SRC")
    if not src:
        return {"skipped": "VJEPA2_SRC not set"}, [
            "## Training step beside facebookresearch/vjepa2", "",
            "Not run: set VJEPA2_SRC=<a checkout of facebookresearch/vjepa2> (make bench ARGS='--only reference')."]
    check_checkout(src)
    workdir = Path(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    cache = _make_cache(workdir)
    shim = timm_shim(workdir)
    base = [f"data.cache={cache}", f"runs_dir={workdir / 'runs'}"] + CPU + VITS + PLAIN  # vjepa2 has no stem, no local term
    res = measure_steps(src, shim, SMOKE, base, warmup=3 if quick else 5, rounds=2 if quick else 5, steps=3 if quick else 8)
    shutil.rmtree(workdir, ignore_errors=True)
    return summarise(res, src, shim, "ViT-S class (dim 384, depth 6, heads 6; predictor 192 x 4), 32x96x96, tubelet "
                                     "4x16x16 (288 tokens), batch 2")


def _precision(name: str) -> str:
    return "bf16" if "bf16" in name else "fp32"


def _ratio(res: dict, name: str) -> str:
    return "-" if name.startswith("vjepa2") else f"{res['ratio'][name]:.2f}x"


def summarise(res: dict, src: str, shim: str, size: str, precision: str = "fp32"):
    """Ratios against the reference at each contender's precision; the verdict reads `precision`.
    A measurement stopped at its deadline is summarised on the rounds it has (none: said so)."""
    med = {k: statistics.median(v) for k, v in res["times"].items() if v}
    ref = {_precision(k): med[k] for k in med if k.startswith("vjepa2")}
    res.update(median_step_s=med, ratio={k: ref[_precision(k)] / v for k, v in med.items()
                                         if not k.startswith("vjepa2") and _precision(k) in ref},
               vjepa2_commit=_commit(src), timm="stand-in (drop_path unused at rate 0)" if shim else "installed")
    same = {k: r for k, r in res["ratio"].items() if _precision(k) == precision}
    rounds = min((len(v) for v in res["times"].values()), default=0)
    title = "## Training step beside facebookresearch/vjepa2 (equal work: the same batches, context and target ids)"
    if not same:
        return res, [title, "", f"{size}: no timed round ({res.get('stopped') or 'no contender at ' + precision})."]
    best = max(same, key=same.get)
    ok = same[best] >= TARGET
    lines = [
        title,
        "",
        f"{size}, {res['device']}" + (f", {res['threads']} threads" if res["device"] == "CPU" else "")
        + f", torch {res['torch']}; context tokens per mask set {res['context_tokens']}, "
        f"targets {res['target_tokens']}; vjepa2 {res['vjepa2_commit']} (sin-cos positions; timm {res['timm']}). "
        f"Median of {rounds} alternating rounds; each ratio against the reference at the same precision."
        + (f" Stopped early: {res['stopped']}." if res.get("stopped") else ""),
        "",
        "| step | median (ms) | rounds (ms) | warm-up (s) | reference / this |",
        "|---|---|---|---|---|",
        *(f"| {k} | {med[k] * 1000:.0f} | {', '.join(f'{t * 1000:.0f}' for t in res['times'][k])} | "
          f"{res['warmup_s'][k]:.1f} | {_ratio(res, k)} |" for k in med),
        "",
        f"Verdict: at equal work in {precision}, {best} is {same[best]:.2f}x the reference's step (target >= {TARGET}x): "
        f"{verdict(ok)}.",
    ]
    return res, lines
