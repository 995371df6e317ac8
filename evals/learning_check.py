"""`make learning-check [CUE=lesions|layers|scanners]`: does `make pretrain` learn something a random encoder lacks?

On a cohort where the answer is known (a cohort `ingest.synth` generates, whose class lives in
one kind of local cue: macular lesions, or the thickness of one retinal layer in a macular
patch; `SOURCE=` takes any AI-READI-shaped root whose participants.tsv carries labels), this
builds the cache, pretrains the recipe (configs/pretrain_check.yaml, the production recipe at
check size; `ARGS` overrides its keys), and probes the final checkpoint, a random-init encoder
of the same architecture, the majority class and a supervised reference (`make finetune` from
random init: the same architecture trained on the labels) with the same heads on the same
participants. It reports test balanced accuracy pretrained minus random-init with a
paired bootstrap interval over participants for both tasks, label-efficiency curves (probes on
10%, 25% and 100% of the labelled train participants, the supervised reference trained on the
same subsets), for `CUE=scanners` every scanner held out in turn and, with `--finetune`
(FINETUNE=1), `make finetune` from the checkpoint and from random init on 10% and 100% of the
labels against the frozen probe (the head val chose). Every stage is
resumable: a re-run does only what is left. Writes <out>/<cue>/result.json, result.md and
result.png (and, as soon as the features exist, result_interim.json and .md with the headline rows,
for a run cut short); docs/learning-check.md keeps the decisions behind it.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing.connection
import resource
import time
import traceback
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from cache import build as cache_build
from cache.config import CacheConfig
from evals import check_probes, features, finetune, probe, subsets, token_probe
from evals.config import ProbeConfig
from ingest import synth
from octfm import cli, config, fsio, plots, procs
from train import checkpoint, metrics, pretrain, runtime
from train.config import TrainConfig
from train.model import objective
from train.run_folder import RunFolder

DEV_SEED = 16  # the development cohorts' generator seed; a confirmation run takes one never used (--seed)
COHORT = synth.SynthConfig(participants=1000, scale=4, seed=DEV_SEED, lesions=10.0, bad_files=False, unlabeled=0)


@dataclasses.dataclass(frozen=True)
class Cue:
    """One kind of class cue: the cohort that carries it (named, so cues sharing it share the
    cohort, cache and pretraining) and how probes split it (`splits`: the cohort's own;
    `scanners`: each scanner held out in turn, evals/subsets.py)."""
    cohort_name: str
    cohort: synth.SynthConfig
    protocol: str
    target: float  # pretrained minus random-init, binary task, with the paired interval above 0
    what: str


CUES = {
    "lesions": Cue("lesions", COHORT, "splits", 0.10, "macular foci and cysts, more of them with the class"),
    "layers": Cue("layers", dataclasses.replace(COHORT, lesions=0.0, layers=0.20), "splits", 0.10,
                  "a thicker inner nuclear layer over a macular patch, growing with the class"),
    "scanners": Cue("lesions", COHORT, "scanners", 0.05,
                    "the lesions cohort, probes trained on three scanners and tested on the fourth"),
}
CACHE_ARGS = ["preprocess.target_shape=[32,128,128]"]


@dataclasses.dataclass(frozen=True)
class Size:
    """One size of the check (make learning-check SIZE=...): the production recipe at that size
    (one cohort and cache for all), the fine-tuning recipe's size keys (configs/finetune.yaml is
    the one recipe for both starts and for the references, which are its from-scratch runs; a GPU's
    batch of 128 needs a step budget and val scores by steps, as decision 17 set for the references
    then), and how many random-init encoders its random-init rows average (decision 44)."""
    config: str
    finetune_args: tuple[str, ...] = ()
    # the references, fine-tuning runs and headline tasks at once, each in its own process (Stages.together), on
    # this many torch threads each (0: torch's default, the machine's cores); None: one after another
    together: int | None = None
    random_draws: int = 3   # random-init encoders whose mean each random-init row reads (decision 44)


# the CPU size at once too (decision 47): three single-thread processes run 1.5x the steps per second of one
# process on both cores (this model's kernels are too small to use two threads well; docs/measurements.md)
SIZES = {"cpu": Size("configs/pretrain_check.yaml", together=1),
         "gpu": Size("configs/pretrain_check_gpu.yaml",
                     ("batch_size=128", "epochs=100000", "max_steps=3700", "val_every=50", "patience=4", "workers=null"),
                     together=0, random_draws=5)}
# Stages.together's processes at once: each starts its own loader workers on the 16 cores of a lent GPU machine
TOGETHER_MAX = 4
FRACTIONS = (0.1, 0.25, 1.0)  # of the labelled train participants, for the label-efficiency curves
FINETUNE_FRACTIONS = (0.1, 1.0)  # `--finetune`: make finetune from the checkpoint and from random init
FULL_LABEL_BUDGET = ("epochs=10", "frozen_epochs=1")  # on all labels: about 3,900 steps, not 40 epochs' 15,700
# what the label-efficiency rows select on (issue 40, item 10): said in result.json
SELECTION = ("at every label fraction the probes' grid, the head kind and early stopping select on the full val "
             "split (val labels beyond the fraction); no row selects on a val subset of the same fraction")
# the held-out-scanner rows (issue 40, item 7): the pretraining is the lesions run, which saw every scanner
TRANSDUCTIVE = ("transductive: the pretraining (the lesions run) saw the train volumes of every scanner, the held-out "
                "one's included; only the probes hold it out")
FINETUNE_TARGET = 0.05  # fine-tuned pretrained minus random-init at the smallest fraction (issue 28)
BINARY, MULTI = "diabetic", "study_group"
STANDARDIZED = {True: "The heads read each feature channel standardised by the training rows' statistics (decision 21).",
                False: "The heads read the features as they are, each token (the linear head: the pooled vector) "
                       "normalised on its own (the protocol before decision 21)."}


class Stages:
    """Wall and CPU seconds (this process and its children) per stage, for the summary."""

    def __init__(self):
        self.times: dict[str, dict] = {}

    @staticmethod
    def _cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    def run(self, name: str, fn):
        print(f"learning-check: {name} ...", flush=True)
        t0, c0 = time.perf_counter(), self._cpu()
        out = fn()
        self.times[name] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(self._cpu() - c0, 1)}
        print(f"learning-check: {name} done in {self.times[name]['wall_s']}s (cpu {self.times[name]['cpu_s']}s)",
              flush=True)
        return out

    def together(self, group: str, jobs: dict[str, tuple], threads: int) -> dict:
        """Each named job, (a module-level function, its arguments), in its own process, all at
        once: at GPU size the supervised references, the fine-tuning runs and the curve's probe
        heads each leave the GPU mostly idle by their step rates (a host-bound step of batch 128,
        a step of batch 4, a head step of batch 32; docs/accelerators.md), at most TOGETHER_MAX
        at once, started in the order given, on `threads` torch threads each (Size.together: one at
        CPU size, 0 at GPU size for torch's default). Each job's wall and CPU seconds are its own
        process's; `group`'s wall is the jobs' together."""
        print(f"learning-check: {group}: {len(jobs)} jobs, {min(len(jobs), TOGETHER_MAX)} at once ...", flush=True)
        t0 = time.perf_counter()

        def ended(name: str, wall: float, cpu: float) -> None:
            self.times[name] = {"wall_s": wall, "cpu_s": cpu, "together": group}
            print(f"learning-check: {name} done in {wall}s (cpu {cpu}s, its own process)", flush=True)

        out = in_processes(jobs, TOGETHER_MAX, ended, threads)
        self.times[group] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": None}
        print(f"learning-check: {group} done in {self.times[group]['wall_s']}s", flush=True)
        return out


def in_processes(jobs: dict, width: int, ended=None, threads: int = 0) -> dict:
    """{name: result} of each named job, (a module-level function, its arguments), each in its
    own process, `width` at a time, started in the order given, each on `threads` torch threads
    (0: torch's default); `ended(name, wall s, cpu s)` as each one ends. A failure, or Ctrl-C,
    is raised at once: the queued jobs do not start and the running ones are ended, not waited for
    (a supervised reference runs tens of minutes; a pool's shutdown would wait for it)."""
    ctx = procs.worker_context()
    queued, running, out = list(jobs.items()), {}, {}
    try:
        while queued or running:
            while queued and len(running) < width:
                name, (fn, args) = queued.pop(0)
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_job, args=(send, threads, fn, args), name=f"octfm-job {name}")
                proc.start()
                send.close()
                running[recv] = (name, proc)
            for recv in multiprocessing.connection.wait(list(running)):
                name, proc = running.pop(recv)
                out[name], wall, cpu = _job_result(name, recv, proc)
                if ended:
                    ended(name, wall, cpu)
    finally:
        for _, proc in running.values():
            proc.terminate()
        for _, proc in running.values():
            proc.join()
    return {name: out[name] for name in jobs}


def _job(send, threads: int, fn, args) -> None:
    """A job's process: _timed(threads, fn, *args) sent back as (True, result) or, raised, (False,
    the exception with its traceback in a note)."""
    try:
        result = (True, _timed(threads, fn, *args))
    except BaseException as exc:  # noqa: BLE001 - re-raised by the parent (in_processes)
        exc.add_note("in the job's process:\n" + "".join(traceback.format_exception(exc)))
        result = (False, exc)
    try:
        send.send(result)
    except Exception as exc:  # noqa: BLE001 - the result or the exception does not pickle
        what = "result" if result[0] else f"exception ({result[1]!r})"
        send.send((False, RuntimeError(f"{getattr(fn, '__name__', fn)}: its {what} could not be sent back: "
                                       f"{type(exc).__name__}: {exc}")))


def _job_result(name: str, recv, proc) -> tuple:
    """A finished job's (result, wall s, cpu s); its exception raised; a process that died without
    an answer said."""
    try:
        ok, value = recv.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"{name}: its process ended without a result (exit status {proc.exitcode}; out of "
                           "memory?)") from None
    proc.join()
    if not ok:
        raise value
    return value


def _call(job: tuple):
    """A job, (a module-level function, its arguments), run here."""
    fn, args = job
    return fn(*args)


def _timed(threads: int, fn, *args):
    """fn(*args) in a job's process on `threads` torch threads (0: as it is), with its wall and
    CPU seconds (Stages.together)."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    t0, c0 = time.perf_counter(), Stages._cpu()
    out = fn(*args)
    return out, round(time.perf_counter() - t0, 1), round(Stages._cpu() - c0, 1)


# What each kept result is made by: its entry files, whose import closure (config.import_closure) keys it, so an
# edit to any file they import makes it afresh (config.source_digest) and an edit elsewhere keeps it
COHORT_CODE = ("ingest/synth.py",)
# `make pretrain`, and the cache builder: a run is named for its cache's path, not its contents (recipe_name)
PRETRAIN_CODE = ("train/pretrain.py", "cache/build.py")
# a fine-tuning run's folder (a supervised reference's too: its from-scratch run) sits under its pretraining run
# (keyed on PRETRAIN_CODE); its own training loop, head,
# participants, config defaults, the probes' fit (its fitted start, head_init: probe), the start features, the val
# score that picks its best epoch and the labelled data key its name too, through what evals/finetune.py imports
FINETUNE_CODE = ("evals/finetune.py",)
# files an entry imports that make none of its results, each with why (none today: `make plan`, train/plan.py,
# sits beside the trainer and no entry imports it, so an edit to it keeps the runs without an exclusion)
NOT_KEYED: dict[str, str] = {}


def keyed_files(code: Sequence[str]) -> list[str]:
    """The files whose contents key a result made by `code` (one of the *_CODE entries): every file
    they import, less NOT_KEYED."""
    return [f for f in config.import_closure(*code) if f not in NOT_KEYED]


def code_key(code: Sequence[str], length: int = 12) -> str:
    """The content key of keyed_files(code)."""
    return config.source_digest(*keyed_files(code), length=length)


def eval_device(train_device: str) -> str:
    """Where the check's features and fine-tuning run: cuda when the pretraining does (or may,
    `auto`) and one is here; else the cpu."""
    import torch

    return "cuda" if train_device in ("cuda", "auto") and torch.cuda.is_available() else "cpu"


def cohort(root: Path, cfg: synth.SynthConfig) -> str:
    """The generated cohort, written once per generator config and generator code (a marker names both)."""
    participants = cfg.participants
    marker = root / "cohort.json"
    want = json.dumps({**dataclasses.asdict(cfg), "code": code_key(COHORT_CODE)}, sort_keys=True)
    if not (marker.exists() and marker.read_text() == want):
        counts = synth.generate(root, cfg, progress=True)
        print(f"learning-check: cohort of {participants} participants, {counts['good']} volumes in {root}")
        marker.write_text(want)
    else:
        print(f"learning-check: cohort in {root} reused")
    return str(root)


def build_cache(source: str, cache: Path) -> str:
    cfg = config.load(CacheConfig, "configs/cache.yaml", CACHE_ARGS)
    cache_build.build(source, str(cache), cfg, progress=True)
    return str(cache)


def recipe_name(config_path: str, cache: str, overrides: Sequence[str], code: Sequence[str] = PRETRAIN_CODE) -> str:
    """A run name per recipe, cache and code, so a changed ARGS, SOURCE or trainer (the sources
    under `code`) trains afresh and an unchanged one resumes; an edit to the probes alone keeps
    the pretraining."""
    blob = "\n".join([Path(config_path).read_text(), cache, *overrides, code_key(code)])
    return "pretrain_" + hashlib.sha256(blob.encode()).hexdigest()[:8]


def pretrain_run(config_path: str, cache: str, out: Path, overrides: Sequence[str]) -> Path:
    name = recipe_name(config_path, cache, overrides)
    args = ["--config", config_path, f"data.cache={cache}", f"runs_dir={out}", f"name={name}", *overrides]
    pretrain.main(args)  # raises on failure; resumes the run's newest checkpoint, or has nothing to do
    return out / name


class Tuned(NamedTuple):
    prob: np.ndarray   # the best epoch's class probabilities for the check's rows
    run: dict          # best epoch, epochs run and val balanced accuracy per epoch (result.json's finetune.runs)
    ckpt: str          # the best epoch's checkpoint (a reference's frozen features read its encoder)


def finetuned(ckpt: str, cache: str, out: Path, rows: list[dict], init: str, fraction: float, seed: int,
              n_boot: int, args: Sequence[str], device: str = "cpu", train_seed: int | None = None,
              progress: bool = True) -> Tuned:
    """`make finetune` (configs/finetune.yaml as users run it; on the cpu in fp32, on cuda in bf16) of the check's
    checkpoint or, with init=random, of the same architecture from scratch, on the label
    fraction's participants (the probes' subsets: the same seed; on all labels a shorter budget,
    FULL_LABEL_BUDGET, which `args` can override); resumable. `train_seed` (None: the seed) varies the
    training alone on the same participants. Returns its best epoch's class probabilities for `rows`
    and its val curve (a lent GPU's call brings back only what the result holds)."""
    tag = finetune_tag(init, fraction, train_seed, seed)
    cfg = finetune.run_config(ckpt, cache, out / tag, init, fraction, seed, BINARY, device, f"bootstrap={n_boot}",
                              *(FULL_LABEL_BUDGET if fraction == 1.0 else ()),
                              *(() if train_seed is None else (f"train_seed={train_seed}",)), *args)
    ft = finetune.Finetuner(cfg, runtime.setup(cfg.device, cfg.precision))
    if [r["relpath"] for r in ft.rows] != [r["relpath"] for r in rows]:
        raise RuntimeError(f"{out / tag}: fine-tuning read other rows than the probes")  # cannot pair them
    res = ft.run(progress=progress)
    top = res["probes"][0]
    return Tuned(res["prob"], {"fraction": fraction, "init": init, "train_seed": train_seed, "head": top["head"],
                               "head_fit": top.get("head_fit"), "best_epoch": top["best_epoch"],
                               "best_step": top.get("best_step"), "epochs_run": res["epochs_run"],
                               "steps_run": ft.step, "val_every": cfg.val_every, "patience": cfg.patience,
                               "val": [round(h["balanced_accuracy"], 4) for h in res["history"]]},
                 res["best_checkpoint"])


def tuned_line(run: dict) -> str:
    """One fine-tuning run in result.md: its head, best epoch and val per epoch."""
    seed = "" if run["train_seed"] is None else f", training seed {run['train_seed']}"
    start = f" (started as a probe with val {run['head_fit']['val_balanced_accuracy']:.2f})" if run.get("head_fit") else ""
    return (f"- {pct(run['fraction'])}, {run['init']} init{seed}, {run['head']} head{start}: best epoch "
            f"{run['best_epoch']} of {run['epochs_run']}; " + " ".join(f"{v:.2f}" for v in run["val"]))


def finetune_tag(init: str, fraction: float, train_seed: int | None, seed: int = DEV_SEED) -> str:
    """A fine-tuning run's folder name under its pretraining run: init, fraction, the seed that picks
    its participants (a re-run with `--probe seed=N` draws others: a run is reused only for the very
    participants it trained on), training seed and the fine-tuning code (FINETUNE_CODE)."""
    return (f"{init}_{round(fraction * 100)}pct_s{seed}" + ("" if train_seed is None else f"_t{train_seed}") +
            "_" + code_key(FINETUNE_CODE, length=8))


def finetune_rows(rows: list[dict], tuned: dict, frozen: dict, fs: list, n_boot: int, seed: int,
                  supervised: dict | None = None) -> list[dict]:
    """Per fraction: fine-tuned from the checkpoint and from random init (test balanced accuracy,
    the paired difference), fine-tuned against the frozen probe (the head val chose) of the same encoder on
    the same participants and, where a supervised reference was trained on them (`supervised`:
    {fraction: its chosen head's probabilities}), against it: label efficiency with fine-tuning.
    `tuned`: {fraction: {init: [probabilities per training seed]}}; a fine-tuned row is the mean
    over its seeds, every seed scored on each participant resample (decision 13)."""
    out, te, supervised = [], check_probes.tested_rows(fs), supervised or {}
    for f in sorted(tuned):
        p = tuned[f]["pretrained"]
        against = {"random_init": ("pretrained_minus_random_init", tuned[f]["random"]),   # name: (difference key, runs)
                   "frozen": ("finetuned_minus_frozen", [frozen[f]])}
        if f in supervised:
            against["supervised"] = ("finetuned_minus_supervised", [supervised[f]])
        row = {"fraction": f, "train_seeds": len(p), "pretrained": check_probes.mean_score(BINARY, rows, p, te, n_boot, seed),
               "per_seed": {init: [check_probes.score(BINARY, rows, q, te, 0, seed)["balanced_accuracy"] for q in runs]
                            for init, runs in (("pretrained", p), ("random_init", tuned[f]["random"]))}}
        for name, (key, q) in against.items():
            row[name] = check_probes.mean_score(BINARY, rows, q, te, n_boot, seed)
            row[key] = check_probes.mean_paired(BINARY, rows, p, q, te, n_boot, seed)
        out.append(row)
    return out


def finetune_against_supervised(points: list[dict]) -> str | None:
    """At the smallest fraction with a supervised reference: fine-tuned from the checkpoint
    against the reference trained on the same labels (an extra row beside the label-efficiency
    target, which reads a frozen probe)."""
    for p in points:
        if "finetuned_minus_supervised" in p:
            return (f"fine-tuned at {pct(p['fraction'])} of labels vs the supervised reference trained on them: "
                    f"{p['pretrained']['balanced_accuracy']:.3f} vs {p['supervised']['balanced_accuracy']:.3f}, "
                    f"{_diff(p['finetuned_minus_supervised'])}")
    return None


def finetune_verdict(points: list[dict]) -> str:
    """Issue 28's target at the smallest fraction: fine-tuned pretrained minus random-init >= +0.05
    with the paired lower bound above 0, and fine-tuned >= the frozen probe with the head val chose;
    then, as readings without a target, the same pair at each larger fraction (issue 64: at 10% and
    at 100% of labels). Both starts are `make finetune` under one recipe (the random start is the
    supervised reference)."""
    first = points[0]
    d, lo = first["pretrained_minus_random_init"]["difference"], first["pretrained_minus_random_init"]["difference_ci95"][0]
    ok = d >= FINETUNE_TARGET and lo is not None and lo > 0 and \
        first["pretrained"]["balanced_accuracy"] >= first["frozen"]["balanced_accuracy"]
    head = (f"fine-tuning, from the checkpoint against from scratch and against the frozen probe: "
            f"{'PASS' if ok else 'FAIL'} (target at {pct(first['fraction'])} of labels: pretrained - random-init >= "
            f"+{FINETUNE_TARGET:.2f} with the interval above 0, and fine-tuned >= frozen)")
    return "\n".join([head, *(finetune_point_line(p) for p in points)])


def finetune_point_line(p: dict) -> str:
    """One fraction's fine-tuning reading: the two starts and the frozen probe, with paired intervals."""
    seeds = ""
    if p.get("train_seeds", 1) > 1:  # the interval resamples participants for these seeds: say how the seeds spread
        per = np.subtract(p["per_seed"]["pretrained"], p["per_seed"]["random_init"])
        seeds = (f", mean of {p['train_seeds']} training seeds (per seed {', '.join(f'{d:+.3f}' for d in per)}; "
                 f"{int((per > 0).sum())} of {len(per)} above 0)")
    ft = p["pretrained"]["balanced_accuracy"]
    return (f"- {pct(p['fraction'])} of labels{seeds}: fine-tuned {ft:.3f}, from scratch "
            f"{p['random_init']['balanced_accuracy']:.3f}, frozen probe (head chosen on val) "
            f"{p['frozen']['balanced_accuracy']:.3f}; pretrained - random-init {_diff(p['pretrained_minus_random_init'])}, "
            f"fine-tuned - frozen {_diff(p['finetuned_minus_frozen'])}")


def chosen_on_val(res: dict, encoder: str) -> str:
    """The head kind whose val score ranks first for an encoder (the test split never chooses)."""
    heads = [p for p in res["probes"] if p["encoder"] == encoder]
    return max(heads, key=lambda p: probe.val_rank(p["val_balanced_accuracy"], p["val_auroc"]))["head"]


def reference_row(task: str, rows: list[dict], sup: dict, rand: dict, fs: list, n_boot: int, seed: int) -> dict:
    """The supervised reference (all labels) against the random-init encoder (the mean of its draws),
    heads chosen on val."""
    te = check_probes.tested_rows(fs)
    s, r = (check_probes.mean_score(task, rows, check_probes.probs(f), te, n_boot, seed) for f in (sup, rand))
    d = check_probes.mean_paired(task, rows, check_probes.probs(sup), check_probes.probs(rand), te, n_boot, seed)
    return {"supervised": s["balanced_accuracy"], "supervised_ci95": s["ci95"], "random_init": r["balanced_accuracy"],
            "head": check_probes._heads(sup[check_probes.CHOSEN]), **d}


def online_curve(run_dir: Path) -> list[dict]:
    """The run's online-probe records (split `probe` in metrics.jsonl, keys `<task>/knn_bal_acc`
    and `<task>/ridge_bal_acc`, named `probe/<task>/...` here as in W&B), when it logged any."""
    probe = metrics.read_splits(run_dir).get("probe", {})
    return [{"step": step, **{f"probe/{k}": v for k, v in r.items() if k.endswith("_bal_acc")}}
            for step, r in sorted(probe.items())]


def training_summary(run_dir: Path) -> dict:
    train = [r for _, r in sorted(metrics.read_splits(run_dir).get("train", {}).items()) if "rankme" in r]
    if not train:
        return {}
    return {"steps": train[-1]["step"], "loss": [train[0]["loss"], train[-1]["loss"]],
            "rankme": [train[0]["rankme"], train[-1]["rankme"]]}


def label_efficiency_check(result: dict) -> tuple[bool, str] | None:
    """At the smallest label fraction: pretrained + probe against the supervised reference
    trained on the same participants (None when no reference was trained)."""
    if "label_efficiency" not in result:  # the interim result: no curve yet
        return None
    points = result["label_efficiency"]["points"]
    first = points[0]
    if "supervised" not in first:
        if not any("supervised" in p for p in points):  # no reference trained
            return None
        # `--reference-fraction` at larger fractions only: said, not dropped, and no FAIL from it
        return True, f"at {pct(first['fraction'])} of labels no supervised reference: the label-efficiency target not read"
    p, s = first["pretrained"]["balanced_accuracy"], first["supervised"]["balanced_accuracy"]
    return p >= s, (f"at {pct(first['fraction'])} of labels pretrained {p:.3f} vs supervised {s:.3f} "
                    f"(target: pretrained >= supervised)")


def headline_row(task: dict) -> dict:
    """The comparison a task's verdict reads: both encoders through the one head kind chosen on their
    mean val (decision 49; each encoder's own choice, decision 8's, stays beside it as CHOSEN)."""
    return task["comparisons"][check_probes.SAME_KIND]


def verdict(result: dict) -> str:
    b, m = headline_row(result["tasks"][BINARY]), headline_row(result["tasks"][MULTI])
    lo, target = b["difference_ci95"][0], result["target"]
    ok = b["difference"] >= target and lo is not None and lo > 0
    need_multi = result["protocol"] == "splits"
    ok = ok and (m["difference"] >= 0 or not need_multi)
    eff = label_efficiency_check(result)
    ok = ok and (eff is None or eff[0])
    how = " (transductive pretraining)" if result["protocol"] == "scanners" else ""
    return (f"learning-check [{result['cue']}]{how}: {'PASS' if ok else 'FAIL'}: pretrained - random-init"
            f"{draws_said(result)} balanced accuracy "
            f"(test, both encoders through the head kind chosen on their mean val, decision 49): {BINARY} "
            f"({b['pretrained_head']}) {b['difference']:+.3f} [{_f(lo)}, {_f(b['difference_ci95'][1])}] "
            f"({b['pretrained']:.3f} vs {b['random_init']:.3f}), {MULTI} ({m['pretrained_head']}) "
            f"{m['difference']:+.3f} [{_f(m['difference_ci95'][0])}, {_f(m['difference_ci95'][1])}] "
            f"({m['pretrained']:.3f} vs {m['random_init']:.3f}){'; ' + eff[1] if eff else ''}; target {BINARY} "
            f">= +{target:.2f} with the interval above 0{f', {MULTI} >= 0' if need_multi else ''}")


def draws_said(result: dict) -> str:
    """' (mean of K draws)' where random init is read over several draws (decision 44); '' for one."""
    k = result.get("random_draws", 1)
    return f" (mean of {k} draws)" if k > 1 else ""


def draws_line(result: dict) -> str | None:
    """Each random-init draw's row for the binary task, through the headline's heads (None for one draw)."""
    c = headline_row(result["tasks"][BINARY])
    if "random_draws" not in c:
        return None
    seeds = result.get("random_init_seeds") or [None] * len(c["random_draws"])
    each = "; ".join(f"draw {d['draw']} (init seed {s}) {d['random_init']:.3f} ({d['head']}), pretrained - it {_diff(d)}"
                     for d, s in zip(c["random_draws"], seeds))
    return (f"Random init is the mean of {len(c['random_draws'])} encoders drawn with their own init seeds, each "
            f"read through the head kind chosen for the pair (decisions 44 and 49); {BINARY}: {each}.")


def _f(v) -> str:
    return "n/a" if v is None else f"{v:+.3f}"


def _diff(d: dict) -> str:
    return f"{d['difference']:+.3f} [{_f(d['difference_ci95'][0])}, {_f(d['difference_ci95'][1])}]"


def markdown(result: dict) -> str:
    held_out = " (each test row scored by probes trained on the other three scanners)" \
        if result["protocol"] == "scanners" else ""
    lines = [f"# Learning check: {result['cue']}", "", result["verdict"], "",
             f"Cue: {result['what']}. Source `{result['source']}`, cache `{result['cache']}`, run `{result['run']}` "
             f"(step {result['step']}; objective: {result.get('objective', 'not recorded')}). "
             f"Intervals: 95% bootstrap over test participants ({result['bootstrap']} resamples); a difference "
             f"is paired (both encoders scored on each resample){held_out}. "
             f"{STANDARDIZED[result.get('probe_standardize', False)]}", ""]
    for task, t in result["tasks"].items():
        lines += [f"## {task} ({t['classes']} classes; test: {t['test_rows']} volumes, {t['test_participants']} "
                  f"participants; majority class {t['majority_class']:.3f})", "",
                  "| heads | val: pretrained / random | test: pretrained | test: random-init | "
                  "test: pretrained - random [95% CI] |", "|---|---|---|---|---|"]
        for label, c in t["comparisons"].items():
            heads = c["pretrained_head"] if c["pretrained_head"] == c["random_head"] else \
                f"{c['pretrained_head']} / {c['random_head']}"
            lines.append(f"| {label} ({heads}) | {_num(c['val']['pretrained'])} / {_num(c['val']['random_init'])} | "
                         f"{c['pretrained']:.3f} | {c['random_init']:.3f} | {_diff(c)} |")
        lines.append("")
    if draws_line(result):
        lines += [draws_line(result), ""]
    if result.get("per_scanner"):
        lines += [f"Each scanner held out ({BINARY}, heads chosen on the other scanners' val rows):", "",
                  "| held-out scanner | participants | pretrained | random-init | pretrained - random [95% CI] |",
                  "|---|---|---|---|---|"]
        lines += [f"| {d} | {r['participants']} | {r['pretrained']:.3f} | {r['random_init']:.3f} | {_diff(r)} |"
                  for d, r in result["per_scanner"].items()]
        lines.append("")
    if result.get("interim"):  # the headline rows only (interim)
        return "\n".join(lines + [result["interim"] + ".", ""])
    ref = result.get("supervised_reference")
    if ref:
        lines += ["Supervised reference: the same encoder trained from scratch on the diabetic labels of the train split "
                  "(`make finetune` from random init, the fine-tuning rows' recipe; it sees labels that pretraining never "
                  "does), its frozen features probed like the pretrained one's. It measures how far label-aware features "
                  "of this architecture get on this cohort.", "",
                  "| task | supervised (head) | random-init | supervised - random [95% CI] |", "|---|---|---|---|"]
        lines += [f"| {t} | {r['supervised']:.3f} ({r['head']}) | {r['random_init']:.3f} | {_diff(r)} |"
                  for t, r in ref.items()]
        lines.append("")
    if result.get("supervised_training"):
        lines += [reference_training_line(result["supervised_training"]), ""]
    pts = result["label_efficiency"]["points"]
    with_sup = any("supervised" in p for p in pts)  # `--reference-fraction`: a reference at some fractions only
    lines += [f"Label efficiency ({result['label_efficiency']['task']}, test balanced accuracy, heads chosen on the "
              "full val rows; probes trained on a stratified, nested fraction of the labelled train participants"
              f"{', the supervised reference trained on the same ones' if with_sup else ''}"
              f"{head_steps(result['label_efficiency'])}):", "",
              f"| labels (participants) | pretrained | random-init{draws_said(result)} | " +
              ("supervised | " if with_sup else "") +
              "pretrained - random [95% CI] |" + (" pretrained - supervised [95% CI] |" if with_sup else ""),
              "|---|---|---|---|" + ("---|---|" if with_sup else "")]
    for p in pts:
        enc = [f"{p[e]['balanced_accuracy']:.3f}" for e in ("pretrained", "random_init")]
        if with_sup:
            enc.append(f"{p['supervised']['balanced_accuracy']:.3f}" if "supervised" in p else "")
        lines.append(f"| {pct(p['fraction'])} ({p['participants']}) | " + " | ".join(enc) +
                     f" | {_diff(p['pretrained_minus_random_init'])} |" +
                     ((f" {_diff(p['pretrained_minus_supervised'])} |" if "supervised" in p else " |") if with_sup else ""))
    lines.append("")
    if result.get("finetune"):
        n_seeds = result["finetune"]["points"][0].get("train_seeds", 1)
        lines += [f"Fine-tuning ({BINARY}, `make finetune` with configs/finetune.yaml on the same participants; the "
                  "best val epoch scored on test): from the checkpoint and from random init, against the frozen "
                  "probe of the checkpoint (head chosen on val) and the supervised reference trained on the same labels"
                  + (f"; fine-tuned rows are means over {n_seeds} training seeds" if n_seeds > 1 else "") + ".", "",
                  result["finetune"]["verdict"], "", *([result["finetune"]["against_supervised"], ""]
                                                       if result["finetune"].get("against_supervised") else []),
                  "| labels | fine-tuned | fine-tuned random-init | frozen (head chosen on val) | supervised reference | "
                  "fine-tuned - random [95% CI] | fine-tuned - frozen [95% CI] | fine-tuned - supervised [95% CI] |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {pct(p['fraction'])} | {p['pretrained']['balanced_accuracy']:.3f} | "
                  f"{p['random_init']['balanced_accuracy']:.3f} | {p['frozen']['balanced_accuracy']:.3f} | "
                  f"{_num(p['supervised']['balanced_accuracy']) if 'supervised' in p else ''} | "
                  f"{_diff(p['pretrained_minus_random_init'])} | {_diff(p['finetuned_minus_frozen'])} | "
                  f"{_diff(p['finetuned_minus_supervised']) if 'finetuned_minus_supervised' in p else ''} |"
                  for p in result["finetune"]["points"]]
        if n_seeds > 1:
            lines += ["", *(f"Per training seed at {pct(p['fraction'])}: fine-tuned "
                            f"{', '.join(f'{v:.3f}' for v in p['per_seed']['pretrained'])}; random-init "
                            f"{', '.join(f'{v:.3f}' for v in p['per_seed']['random_init'])}."
                            for p in result["finetune"]["points"])]
        if result["finetune"].get("runs"):
            lines += ["", "Each run's val balanced accuracy per epoch (the encoder frozen for configs/finetune.yaml's "
                      "frozen_epochs first):", "",
                      *(tuned_line(r) for r in result["finetune"]["runs"])]
        lines.append("")
    if result.get("token_probe"):
        lines += [f"Is the lesion in the tokens? {result['token_probe']['line']} (evals/token_probe.py).", ""]
    tr = result["training"]
    if tr:
        lines += [f"Pretraining: {tr['steps']} steps, loss {tr['loss'][0]:.4f} -> {tr['loss'][1]:.4f}, "
                  f"RankMe {tr['rankme'][0]:.1f} -> {tr['rankme'][1]:.1f}.", ""]
    curve = result["online_probe"]
    if curve:
        keys = sorted({k for r in curve for k in r if k != "step"})
        lines += ["Online probe (logged during pretraining):", "", "| step | " + " | ".join(keys) + " |",
                  "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {r['step']} | " + " | ".join(_num(r.get(k)) for k in keys) + " |" for r in curve]
    else:
        lines.append("Online probe: the run logged none (`probe/<task>/knn_bal_acc` in metrics.jsonl).")
    lines += ["", "| stage | wall s | cpu s |", "|---|---|---|"]
    lines += [f"| {k}{' (at once, its own process)' if v.get('together') else ''} | {v['wall_s']} | "
              f"{'' if v['cpu_s'] is None else v['cpu_s']} |" for k, v in result["stages"].items()]
    return "\n".join(lines) + "\n"


def _num(v) -> str:
    return "" if v is None else f"{v:.3f}"


def plot(result: dict, path: Path) -> None:
    """Test balanced accuracy per encoder (the headline's heads) with intervals, the
    label-efficiency curve, and the online probe."""
    plt = plots.pyplot()
    curve = result["online_probe"]
    fig, axes = plt.subplots(1, 3 if curve else 2, figsize=(15 if curve else 10, 4), squeeze=False)
    ax = axes[0][0]
    for i, (task, t) in enumerate(result["tasks"].items()):
        c = headline_row(t)
        for j, (name, v, ci) in enumerate((("pretrained", c["pretrained"], c["pretrained_ci95"]),
                                           ("random-init", c["random_init"], c["random_init_ci95"]),
                                           ("majority", t["majority_class"], None))):
            err = None if not ci or ci[0] is None else [[v - ci[0]], [ci[1] - v]]
            ax.bar(i * 4 + j, v, yerr=err, color=f"C{j}", label=name if i == 0 else None, capsize=3)
    ax.set_xticks([1, 5], list(result["tasks"]))
    ax.set_ylabel("test balanced accuracy")
    ax.legend(fontsize=8)
    ax.set_title(f"{result['cue']}: one head kind for both, chosen on val, 95% participant bootstrap", fontsize=9)
    ax = axes[0][1]
    pts = result["label_efficiency"]["points"]
    x = [100 * p["fraction"] for p in pts]
    for j, name in enumerate(("pretrained", "random_init", "supervised")):
        have = [p for p in pts if name in p]  # `--reference-fraction`: the supervised encoder at some fractions
        if have:
            v = [p[name]["balanced_accuracy"] for p in have]
            lo = [p[name]["ci95"][0] if p[name]["ci95"][0] is not None else p[name]["balanced_accuracy"] for p in have]
            hi = [p[name]["ci95"][1] if p[name]["ci95"][1] is not None else p[name]["balanced_accuracy"] for p in have]
            ax.errorbar([100 * p["fraction"] for p in have], v, yerr=[np.subtract(v, lo), np.subtract(hi, v)],
                        marker="o", capsize=3, color=f"C{j}",
                        label=name.replace("_", "-"))
    tuned = (result.get("finetune") or {}).get("points", [])
    for j, name in enumerate(("pretrained", "random_init") if tuned else ()):
        ax.plot([100 * p["fraction"] for p in tuned], [p[name]["balanced_accuracy"] for p in tuned], "s--",
                color=f"C{j}", alpha=0.7, label=f"fine-tuned {name.replace('_', '-')}")
    ax.set_xscale("log")
    ax.set_xticks(x, [f"{v:g}%" for v in x])
    ax.set_xlabel("labelled train participants")
    ax.set_ylabel(f"test balanced accuracy ({result['label_efficiency']['task']})")
    ax.legend(fontsize=8)
    ax.set_title("label efficiency", fontsize=9)
    if curve:
        ax = axes[0][2]
        for k in sorted({k for r in curve for k in r if k != "step"}):
            pts = [(r["step"], r[k]) for r in curve if r.get(k) is not None]
            ax.plot(*zip(*pts), marker="o", label=k)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.set_title("online probe", fontsize=9)
    fig.tight_layout()
    fsio.atomic_write_bytes(str(path), plots.to_png(fig, dpi=90))
    plt.close(fig)


def head_steps(curve: dict) -> str:
    """The heads' update count below all labels (decision 32); results from before it say nothing."""
    n = curve.get("head_steps")
    if not n:
        return ""
    each = f"{n[0]:,}" if len(set(n)) == 1 else f"{min(n):,}-{max(n):,}, each fold its own"
    return f"; below all labels the heads train as many optimizer steps as all labels' ({each}; decision 32)"


def pct(fraction: float) -> str:
    return f"{round(fraction * 100)}%"


def reference_training(run: dict) -> dict:
    """How a reference (its from-scratch fine-tuning run, Tuned.run) trained, for result.json."""
    keys = ("best_epoch", "best_step", "epochs_run", "steps_run", "val_every", "patience", "head")
    return {k: run[k] for k in keys if k in run} | {"best_val_balanced_accuracy": max(run["val"], default=None)}


def reference_training_line(training: dict) -> str:
    """How each supervised reference trained, from reference_training's records."""
    if not training:
        return ""

    def one(frac: str, t: dict) -> str:
        where = f"step {t['best_step']}" if t.get("val_every") else f"epoch {t['best_epoch']}"
        best = t.get("best_val_balanced_accuracy")
        return (f"{frac} of labels {t['steps_run']} steps ({t['epochs_run']} epochs), best val "
                f"{'-' if best is None else f'{best:.3f}'} at {where}")
    return ("Reference training (make finetune from random init, configs/finetune.yaml with the size's keys; the best "
            "val score's state kept): " + "; ".join(one(f, t) for f, t in training.items()) + ".")


def supervised_features(pcfg: ProbeConfig, ckpts: dict, probe_dir: Path) -> dict:
    """{fraction: features} of the references' best checkpoints ({fraction: ckpt}), their encoders
    read in one pass over the cache (no random-init baseline: the check has it)."""
    encoders, tcfg = {}, None
    for frac, ckpt in ckpts.items():
        path, st = checkpoint.load_named(ckpt)
        enc, tcfg, ident = features.checkpoint_encoder(path, state=st)
        encoders[pct(frac)] = (enc, ident)
    feats = probe.encoder_features(dataclasses.replace(pcfg, baselines=False), encoders, tcfg, probe_dir)["feats"]
    return {frac: feats[pct(frac)] for frac in ckpts}


def frozen_probe(fitted: dict) -> np.ndarray:
    """The frozen probe a fine-tuned encoder is set against: its encoder's head chosen on val (the
    check's rule), not a fixed kind."""
    return fitted[check_probes.CHOSEN]["prob"]


def headline_probes(pcfg: ProbeConfig, rows: list[dict], feats: dict, protocol: str, n_boot: int,
                    together: int | None = None) -> dict:
    """The check's headline: both encoders' heads for the two tasks on all labels (`fits`, over
    the protocol's `folds`) and pretrained against random init with heads chosen on val (`tasks`;
    the verdict reads the one kind chosen for the pair, decision 49).
    Done once, right after the features (the interim result); probe_all builds on it. Random init is
    each of its draws (decision 44); a task's fits of every encoder train as one stack of heads
    (check_probes.fit_encoders). `together` (not None): the two tasks each in its own process at
    once, on that many torch threads each, 0 for torch's default (the GPU size: a head's step of
    batch 32 leaves the GPU mostly idle; the CPU size: two single-thread processes use the cores
    better; the same fits)."""
    fs, encs = check_probes.folds(rows, protocol), ["pretrained", *probe.random_draws(feats)]
    jobs = {t: (check_probes.fit_encoders, (pcfg, [feats[e] for e in encs], t, rows, fs, None, True))
            for t in (MULTI, BINARY)}
    done = in_processes(jobs, len(jobs), threads=together) if together is not None else \
        {t: _call(job) for t, job in jobs.items()}
    fits = {t: {"pretrained": done[t][0], "random_init": done[t][1:]} for t in (MULTI, BINARY)}
    return {"folds": fs, "fits": fits,
            "tasks": {t: check_probes.compare(t, rows, fits[t], fs, n_boot, pcfg.seed) for t in (MULTI, BINARY)}}


def curve_fits(pcfg: ProbeConfig, rows: list[dict], feats: dict, fs: list, fractions) -> dict:
    """{(fraction, encoder): fit_encoder's result}: the pretrained encoder's and each random-init draw's
    binary heads at each curve fraction below all labels, each fold's heads for its full split's steps
    (decision 32). They need no reference, so at GPU size they train in their own process beside
    the references (Stages.together) rather than after them in the probes stage. A fraction's
    encoders train as one stack of heads (check_probes.fit_encoders)."""
    people, encs = subsets.nested_fractions(rows, fractions, pcfg.seed), ["pretrained", *probe.random_draws(feats)]
    out = {}
    for f in sorted(people):
        if f < 1.0:
            fits = check_probes.fit_encoders(pcfg, [feats[e] for e in encs], BINARY, rows,
                                             check_probes.narrowed(fs, rows, people[f]), fs)
            out.update({(f, e): fit for e, fit in zip(encs, fits)})
    return out


def probe_all(pcfg: ProbeConfig, rows: list[dict], feats: dict, sup: dict, protocol: str, fractions, n_boot: int,
              tuned: dict | None = None, head: dict | None = None, curve: dict | None = None) -> dict:
    """Heads on every encoder's features: the two tasks on all labels (`head`: headline_probes'
    result, when done already), the binary task's label-efficiency curve (`curve`: curve_fits'
    result, when done already), for the scanners protocol each held-out scanner and, given
    fine-tuned probabilities ({fraction: {init: prob}}), the fine-tuning rows."""
    seed, tuned = pcfg.seed, tuned or {}
    head = head or headline_probes(pcfg, rows, feats, protocol, n_boot)
    fs, fits = head["folds"], head["fits"]
    curve_fit = curve if curve is not None else curve_fits(pcfg, rows, feats, fs, fractions)
    out = {"tasks": head["tasks"]}
    sup_all = {t: check_probes.fit_encoder(pcfg, sup[1.0], t, rows, fs) for t in (MULTI, BINARY)} if 1.0 in sup else {}
    if sup_all:
        out["supervised_reference"] = {t: reference_row(t, rows, sup_all[t], fits[t]["random_init"], fs, n_boot, seed)
                                       for t in (MULTI, BINARY)}
    if protocol == "scanners":
        out["per_scanner"] = check_probes.per_scanner(BINARY, rows, fits[BINARY], fs, n_boot, seed)
    people = subsets.nested_fractions(rows, {*fractions, *tuned}, seed)
    curve, frozen, sup_chosen = [], {}, {}
    for f in sorted(people):
        # below all labels each fold's heads train its full split's steps (decision 32), not `epochs` of fewer rows
        ff, full = check_probes.narrowed(fs, rows, people[f]), None if f == 1.0 else fs
        if f not in fractions:  # a fine-tuning fraction off the curve: only the frozen probe it is set against
            frozen[f] = frozen_probe(check_probes.fit_encoder(pcfg, feats["pretrained"], BINARY, rows, ff, full))
            continue
        encs = {"pretrained": fits[BINARY]["pretrained"] if f == 1.0 else curve_fit[(f, "pretrained")],
                "random_init": fits[BINARY]["random_init"] if f == 1.0 else
                [curve_fit[(f, e)] for e in probe.random_draws(feats)]}
        if f in sup:  # all labels: the reference row's fit where the folds are the same (one fit, not two)
            same = f == 1.0 and all(np.array_equal(a[1], b[1]) for a, b in zip(ff, fs))
            encs["supervised"] = sup_all[BINARY] if same else check_probes.fit_encoder(pcfg, sup[f], BINARY, rows, ff, full)
        if f in tuned:
            frozen[f] = frozen_probe(encs["pretrained"])
            if "supervised" in encs:
                sup_chosen[f] = encs["supervised"][check_probes.CHOSEN]["prob"]
        curve.append({"fraction": f, "participants": len(people[f]),
                      **check_probes.curve_point(BINARY, rows, encs, ff, n_boot, seed)})
    out["label_efficiency"] = {"task": BINARY, "points": curve, "selection": SELECTION}
    if any(f < 1.0 for f in people):  # the steps each fold's heads train below all labels (decision 32)
        out["label_efficiency"]["head_steps"] = [check_probes.fraction_steps(pcfg, tr) for _, tr, _, _ in fs]
    if tuned:
        out["finetune"] = {"task": BINARY, "points": finetune_rows(rows, tuned, frozen, fs, n_boot, seed, sup_chosen)}
    return out


def check(source: str | None, work: Path, out: Path, config_path: str, overrides: Sequence[str],
          cue: str = "lesions", seed: int = DEV_SEED, participants: int = COHORT.participants, n_boot: int = 1000,
          probe_args: Sequence[str] = (), with_supervised: bool = True, fractions=FRACTIONS,
          finetune_fractions: Sequence[float] = (), finetune_args: Sequence[str] = (), finetune_seeds: int = 1,
          reference_fractions: Sequence[float] | None = None, together: int | None = None,
          random_draws: int = 1) -> dict:
    """The whole check for one cue; every stage reuses what an earlier run finished.
    `random_draws`: the random-init encoders whose mean every random-init row reads (decision 44;
    the size's, from main). `finetune_args`: configs/finetune.yaml overrides for every fine-tuning
    run, the references' included (the size's, then the command line's).
    `reference_fractions`: the label fractions that get a supervised reference (None: every one
    of the curve's; the curve keeps its frozen rows at the others). A reference is `make finetune`
    from random init at its fraction: the very run the fine-tuning rows set the checkpoint against.
    `together` (not None): the references and fine-tuning runs each in its own process at once
    (Stages.together), and the headline's two tasks, on that many torch threads each (0: torch's
    default); None: one after another (Size.together)."""
    spec = CUES[cue]
    stages, generated = Stages(), source is None
    device = eval_device(config.load(TrainConfig, config_path, overrides).device)  # refuse bad ARGS before any work
    if reference_fractions is not None and not set(reference_fractions) <= set(fractions):
        raise cli.UsageError(f"--reference-fraction {sorted(set(reference_fractions) - set(fractions))}: not on the "
                             f"label-efficiency curve ({', '.join(map(str, fractions))})")
    if source is None:
        home = work / f"{spec.cohort_name}_seed{seed}"
        cfg = dataclasses.replace(spec.cohort, seed=seed, participants=participants)
        source = stages.run("cohort", lambda: cohort(home / "source", cfg))
        cache_dir = home / "cache"
    else:
        cache_dir = work / ("cache_" + hashlib.sha256(source.encode()).hexdigest()[:8])
    pcfg = config.load(ProbeConfig, "configs/probe.yaml",  # refuse bad --probe keys before any work too
                       [f"cache={cache_dir}", f"bootstrap={n_boot}", "per_device=false", "cross_device=false",
                        "baselines=true", f"baseline_draws={random_draws}", f"device={device}", *probe_args])
    cache = stages.run("cache", lambda: build_cache(source, cache_dir))
    run_dir = stages.run("pretrain", lambda: pretrain_run(config_path, cache, out, overrides))
    ckpt = checkpoint.newest_whole(RunFolder(run_dir).checkpoints())
    probe_dir = RunFolder(run_dir).probe
    reads_tokens = spec.protocol == "splits" and (Path(source) / synth.LESION_TABLE).exists()  # the token probe runs
    grids = ("pretrained", probe.random_draw(1)) if reads_tokens else ()  # its two encoders' tokens, in this pass
    f = stages.run("features", lambda: probe.checkpoint_features(pcfg, ckpt, probe_dir, grids=grids))
    about = {"cue": cue, "what": spec.what, "protocol": spec.protocol, "target": spec.target,
             "source": source, "cohort_seed": seed if generated else None,
             "cache": cache, "run": str(run_dir), "ckpt": ckpt, "step": f["step"],
             "objective": objective(config.load(TrainConfig, config_path, overrides).loss),
             "overrides": list(overrides), "bootstrap": n_boot, "features_reused": f["reused"],
             "probe_standardize": pcfg.standardize, "random_draws": pcfg.baseline_draws,
             "random_init_seeds": probe.draw_seeds(pcfg)}
    dest = out / cue
    head = stages.run("headline probes", lambda: interim(about, pcfg, f, n_boot, dest, together))
    splits = spec.protocol == "splits"  # held-out scanners: no reference nor fine-tuning per fold
    ref_fracs = sorted(fractions if reference_fractions is None else reference_fractions, reverse=True) \
        if with_supervised and splits else []
    tune_keys = [(frac, init, k) for frac in sorted(finetune_fractions) for init in ("pretrained", "random")
                 for k in range(finetune_seeds)] if splits else []
    # a reference is the from-scratch run at its fraction (training seed k=0): one run where both want it
    run_keys = sorted({*tune_keys, *((frac, "random", 0) for frac in ref_fracs)}, key=lambda t: (-t[0], t[1], t[2]))
    # at once, the curve's own heads join them: they need no reference (curve_fits)
    at_once = together is not None and len(run_keys) > 0
    # each job: a module-level function and its arguments, so that it can run in its own process
    runs = {(frac, init, k): (f"fine-tuning ({init} init{'' if k == 0 else f', training seed {pcfg.seed + k}'}), "
                              f"{pct(frac)} of labels",
                              (finetuned, (ckpt, cache, RunFolder(run_dir).root / "finetune", f["rows"], init, frac,
                                           pcfg.seed, n_boot, finetune_args, device, None if k == 0 else pcfg.seed + k,
                                           not at_once)))
            for frac, init, k in run_keys}
    jobs = dict(runs.values())
    if at_once:  # first: a short job that the probes stage waits on, so it does not queue behind long ones
        mine = {e: f["feats"][e] for e in ("pretrained", *probe.random_draws(f["feats"]))}
        jobs = {CURVE_JOB: (curve_fits, (pcfg, f["rows"], mine, head["folds"], fractions)), **jobs}
    done = stages.together("references and fine-tuning", jobs, together) if at_once else \
        {name: stages.run(name, lambda job=job: _call(job)) for name, job in jobs.items()}
    sup, sup_training, tuned = {}, {}, {}
    if ref_fracs:
        refs = {frac: done[runs[(frac, "random", 0)][0]] for frac in ref_fracs}
        read = stages.run("supervised features", lambda: supervised_features(
            pcfg, {frac: r.ckpt for frac, r in refs.items()}, probe_dir))
        for frac, feats_f in read.items():
            sup[frac], sup_training[pct(frac)] = feats_f, reference_training(refs[frac].run)
    for frac, init, k in tune_keys:
        tuned.setdefault(frac, {}).setdefault(init, []).append(done[runs[(frac, init, k)][0]].prob)
    scores = stages.run("probes", lambda: probe_all(pcfg, f["rows"], f["feats"], sup, spec.protocol, fractions, n_boot,
                                                    tuned, head, done.get(CURVE_JOB)))
    result = {**about, **scores, "supervised_reference": scores.get("supervised_reference", {}),
              "supervised_training": sup_training, "finetune_args": list(finetune_args),
              "training": training_summary(run_dir), "online_probe": online_curve(run_dir), "stages": stages.times}
    if spec.protocol == "scanners":
        result["pretraining"] = TRANSDUCTIVE
    result["verdict"] = verdict(result)
    if "finetune" in result:
        result["finetune"]["runs"] = [done[runs[key][0]].run for key in tune_keys]
        result["finetune"]["verdict"] = finetune_verdict(result["finetune"]["points"])
        result["finetune"]["against_supervised"] = finetune_against_supervised(result["finetune"]["points"])
    if reads_tokens:  # a generated cohort's answer key
        # every row but the token probe's first: a lent GPU's call cut in the token probe keeps them (stop 50's was)
        write_result({**result, "verdict": f"{BEFORE_TOKENS}: {result['verdict']}"}, dest, "result_interim")
        tokens = stages.run("token probe", lambda: token_probe.run(
            ckpt, source, probe_dir / "tokens", cache, pcfg.seed, device=device, batch=pcfg.extract_batch,
            features_dir=probe_dir / "features", precision=f["precision"]))
        result["token_probe"] = {**tokens, "line": token_probe.line(tokens)}
    write_result(result, dest, "result")
    plot(result, dest / "result.png")
    return result


CURVE_JOB = "label-efficiency heads, pretrained and random init"
BEFORE_TOKENS = "INTERIM, every row but the token probe's"
INTERIM = ("INTERIM, before the supervised references, label efficiency, fine-tuning and token probe "
           "(result.json has them when the check ends)")


def write_result(result: dict, dest: Path, stem: str) -> None:
    """<stem>.json and <stem>.md in dest, each written atomically."""
    dest.mkdir(parents=True, exist_ok=True)
    fsio.atomic_write_bytes(str(dest / f"{stem}.json"), json.dumps(result, indent=2, default=float).encode())
    fsio.atomic_write_bytes(str(dest / f"{stem}.md"), markdown(result).encode())


def interim(about: dict, pcfg: ProbeConfig, f: dict, n_boot: int, dest: Path, together: int | None = None) -> dict:
    """The headline rows as soon as the features exist, in result_interim.json and .md, and
    their verdict printed: a run cut short (a lent GPU's minutes) keeps the check's main number.
    Returns headline_probes' result, which the final probes reuse."""
    head = headline_probes(pcfg, f["rows"], f["feats"], about["protocol"], n_boot, together)
    res = {**about, "interim": INTERIM, "tasks": head["tasks"]}
    res["verdict"] = f"{INTERIM}: {verdict(res)}"
    write_result(res, dest, "result_interim")
    print(res["verdict"], flush=True)
    return head


def probe_line(probe_dir: Path) -> str:
    """One line from a run's probe reports: pretrained vs random-init test balanced accuracy
    with intervals, each encoder with its head chosen on val (the demo ends with it)."""
    parts = []
    for task in (BINARY, MULTI):
        path = probe_dir / task / "metrics.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())
        enc = {}
        for name in ("pretrained", "random_init"):
            head = chosen_on_val(res, name)
            t = next(p for p in res["probes"] if p["encoder"] == name and p["head"] == head)["test"]
            lo, hi = t["balanced_accuracy_ci95"]
            enc[name] = f"{t['balanced_accuracy']:.2f} [{lo:.2f}, {hi:.2f}]"
        parts.append(f"{task} {enc['pretrained']} vs {enc['random_init']}")
    if not parts:
        raise cli.UsageError(f"{probe_dir}: no probe reports (run `make probe` first)")
    return ("pretrained vs random-init encoder, test balanced accuracy [95% CI over participants], heads chosen "
            "on val: " + "; ".join(parts))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make learning-check", description=__doc__)
    ap.add_argument("--source", default=None, help="AI-READI-shaped dataset root with labels (default: the cohort)")
    ap.add_argument("--work", default="data/learning_check", help="where the cohort and its cache go")
    ap.add_argument("--out", default="runs/learning_check")
    ap.add_argument("--size", choices=list(SIZES), default="cpu",
                    help="the check's size (make SIZE=...): cpu, or gpu for one H100/H200 (configs/pretrain_check_gpu.yaml)")
    ap.add_argument("--config", default=None, help="the pretraining config (default: the size's)")
    ap.add_argument("--cue", choices=list(CUES), default="lesions", help="the kind of class cue (make CUE=...)")
    ap.add_argument("--seed", type=int, default=DEV_SEED,
                    help=f"the generated cohort's seed (default {DEV_SEED}, the development cohorts')")
    ap.add_argument("--participants", type=int, default=COHORT.participants, help="cohort size")
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--probe", action="append", default=[], help="a probe config override (key=value)")
    ap.add_argument("--no-supervised", action="store_true",
                    help="skip the supervised references (make finetune from random init at the curve's fractions)")
    ap.add_argument("--reference-fraction", action="append", type=float, default=None, choices=FRACTIONS,
                    help="train the supervised reference at this label fraction only (repeatable; default every "
                         "fraction of the curve): a lent GPU's call that holds the 10%% reference, not all three")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="train the supervised references and fine-tuning runs one after another (both sizes "
                         "run them at once, each in its own process; the CPU size on one thread each)")
    ap.add_argument("--finetune", action="store_true",
                    help="also fine-tune the checkpoint and a random-init encoder end to end (make finetune) on "
                         f"{', '.join(pct(f) for f in FINETUNE_FRACTIONS)} of labels (make FINETUNE=1)".replace("%", "%%"))
    ap.add_argument("--finetune-fraction", action="append", type=float, default=None,
                    help=f"with --finetune, fine-tune on this label fraction only (repeatable; default "
                         f"{' and '.join(str(f) for f in FINETUNE_FRACTIONS)})")
    ap.add_argument("--finetune-arg", action="append", default=[], help="a fine-tuning config override (key=value)")
    ap.add_argument("--finetune-seeds", type=int, default=1,
                    help="with --finetune, training seeds per init on the same participants; rows are their mean "
                         "(make FT_SEEDS=...)")
    ap.add_argument("--random-draws", type=int, default=None,
                    help="random-init encoders whose mean each random-init row reads (default: the size's, "
                         + ", ".join(f"{k} {v.random_draws}" for k, v in SIZES.items()) + "; decision 44)")
    ap.add_argument("--line", metavar="RUN", default=None,
                    help="only print the one-line comparison from RUN/probe (no work)")
    ap.add_argument("overrides", nargs="*", help="pretraining config overrides (make ARGS)")
    a = ap.parse_args(argv)
    if a.line:
        print(probe_line(RunFolder(a.line).probe))
        return 0
    if a.random_draws is not None and a.random_draws < 1:
        raise cli.UsageError(f"--random-draws: {a.random_draws}; needs at least 1")
    if a.finetune_seeds < 1:
        raise cli.UsageError(f"--finetune-seeds (FT_SEEDS): {a.finetune_seeds}; needs at least 1")
    t0 = time.perf_counter()
    size = SIZES[a.size]
    r = check(a.source, Path(a.work), Path(a.out), a.config or size.config, a.overrides, a.cue, a.seed, a.participants,
              a.bootstrap, a.probe, with_supervised=not a.no_supervised,
              finetune_fractions=(a.finetune_fraction or FINETUNE_FRACTIONS) if a.finetune else (),
              finetune_args=[*(size.finetune_args if a.config is None else ()), *a.finetune_arg],
              finetune_seeds=a.finetune_seeds,
              reference_fractions=a.reference_fraction, together=None if a.one_at_a_time else size.together,
              random_draws=a.random_draws or size.random_draws)
    print(markdown(r))
    print(f"learning-check: wrote {Path(a.out) / a.cue}/result.json, result.md, result.png in "
          f"{time.perf_counter() - t0:.0f}s")
    print(r["verdict"])
    if "finetune" in r:
        if r["finetune"].get("against_supervised"):
            print(r["finetune"]["against_supervised"])
        print(r["finetune"]["verdict"])
    return 0


if __name__ == "__main__":
    cli.run(main)
