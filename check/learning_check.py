"""`make learning-check [CUE=lesions|layers|scanners]`: does `make pretrain` learn something a random encoder lacks?

On a cohort where the answer is known (a cohort `ingest.synth` generates, whose class lives in
one kind of local cue: macular lesions, or the thickness of one retinal layer in a macular
patch; `SOURCE=` takes any AI-READI-shaped root whose participants.tsv carries labels), this
builds the cache, pretrains the recipe (configs/pretrain_check.yaml, the production recipe at
check size; `ARGS` overrides its keys), and probes the final checkpoint, a random-init encoder
of the same architecture, the majority class and a supervised reference (`make finetune` from
random init: the same architecture trained on the labels) with the same heads on the same
participants. It reports test balanced accuracy pretrained minus random-init with a paired
bootstrap interval over participants for both tasks, the frozen probes' label-efficiency curve
(10%, 25% and 100% of the labelled train participants) with the supervised reference at 10%
(`--curve`, CURVE=1: at every fraction), for `CUE=scanners` every scanner held out in turn and,
with `--finetune` (FINETUNE=1), `make finetune` from the checkpoint and from random init on 10%
and 100% of the labels against the frozen probe (the head val chose). One verdict line per
question: does pretraining learn, label efficiency, fine-tuning. Every stage is resumable: a
re-run does only what is left. Writes <out>/<cue>/result.json, result.md and result.png (and,
as soon as the features exist, result_interim.json and .md with the headline rows, for a run
cut short; an earlier run's result files move to <out>/<cue>/previous/ as it starts). The
settings are a CheckConfig (check/config.py); docs/recipe.md, The learning check, says why.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from check import token_probe
from check.cohort import BINARY, CUES, build_cache, cohort, eval_device
from check.config import FINETUNE_FRACTIONS, FRACTIONS, SIZES, CheckConfig
from check.run_names import finetune_tag, recipe_name
from check.report import markdown, plot, probe_line, set_aside_results, write_result
from check.result_rows import (
    curve_fits, headline_probes, online_curve, probe_all, reference_training, supervised_features,
    training_summary)
from check.verdicts import (
    finetune_against_supervised, finetune_verdict, label_efficiency_verdict, pct, verdict, verdict_lines)
from evals import finetune, probe
from evals.config import FinetuneConfig, ProbeConfig
from ingest import synth
from octfm import cli, config
from octfm.procs import call_job, cpu_seconds, git_commit, in_processes
from train import checkpoint, pretrain, runtime
from train.config import TrainConfig
from train.model import objective
from train.run_folder import RunFolder


# Stages.together's processes at once: each starts its own loader workers on the 16 cores of a lent GPU machine
TOGETHER_MAX = 4
FULL_LABEL_BUDGET = ("epochs=10", "frozen_epochs=1")  # on all labels: about 3,900 steps, not 80 epochs' 31,400
# the held-out-scanner rows: the pretraining is the lesions run, which saw every scanner
TRANSDUCTIVE = ("transductive: the pretraining (the lesions run) saw the train volumes of every scanner, the held-out "
                "one's included; only the probes hold it out")


class Stages:
    """Wall and CPU seconds (this process and its children) per stage, for the summary."""

    def __init__(self):
        self.times: dict[str, dict] = {}

    def run(self, name: str, fn):
        print(f"learning-check: {name} ...", flush=True)
        t0, c0 = time.perf_counter(), cpu_seconds()
        out = fn()
        self.times[name] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(cpu_seconds() - c0, 1)}
        print(f"learning-check: {name} done in {self.times[name]['wall_s']}s (cpu {self.times[name]['cpu_s']}s)",
              flush=True)
        return out

    def together(self, group: str, jobs: dict[str, tuple], threads: int) -> dict:
        """Each named job, (a module-level function, its arguments), in its own process, all at
        once: at GPU size the supervised references, the fine-tuning runs and the curve's probe
        heads each leave the GPU mostly idle by their step rates (a host-bound step of batch 128,
        a step of batch 4, a head step of batch 32; docs/accelerators.md), at most TOGETHER_MAX
        at once, started in the order given, on `threads` torch threads each (Size.threads: one at
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


def pretrain_run(config_path: str, cache: str, out: Path, overrides: Sequence[str]) -> Path:
    name = recipe_name(config_path, cache, overrides)
    args = ["--config", config_path, f"data.cache={cache}", f"runs_dir={out}", f"name={name}", *overrides]
    pretrain.main(args)  # raises on failure; resumes the run's newest checkpoint, or has nothing to do
    return out / name


class Tuned(NamedTuple):
    prob: np.ndarray   # the best epoch's class probabilities for the check's rows
    run: dict          # best epoch, epochs run and val balanced accuracy per epoch (result.json's finetune.runs)
    ckpt: str          # the best epoch's checkpoint (a reference's frozen features read its encoder)


def training_seeds(cohort_seed: int | None, probe_seed: int, n: int) -> list[int | None]:
    """Fine-tuning run k's training seed, which also draws the random start's weights. A generated cohort's are
    its own (1000 x cohort seed + k), so two cohorts' from-scratch runs never start from the same encoder and two
    fresh-seed confirmations are two draws (docs/recipe.md, The learning check); on a SOURCE root, the probes'
    seed + k (k = 0: None, the run's own seed)."""
    if cohort_seed is None:
        return [None if k == 0 else probe_seed + k for k in range(n)]
    return [1000 * cohort_seed + k for k in range(n)]


def baseline_seed(cohort_seed: int | None) -> int | None:
    """Where the frozen rows' random-init draws' init seeds start (ProbeConfig.baseline_seed; draw d's is
    this + d). A generated cohort's are its own, 1000 x cohort seed + 500, apart from its fine-tuning
    starts (1000 x cohort seed + k) and from every other cohort's (docs/recipe.md, The learning check); None
    on a SOURCE root: the probes' seed + d."""
    return None if cohort_seed is None else 1000 * cohort_seed + 500


def probe_config(cache_dir: Path, n_boot: int, random_draws: int, device: str, probe_args: Sequence[str],
                 cohort_seed: int | None) -> ProbeConfig:
    """The check's probes: configs/probe.yaml, the check's keys, then --probe. `cohort_seed`: the generated
    cohort whose own random-init draws the rows read (baseline_seed); None (a SOURCE root): the probes' seed + d."""
    draws_from = baseline_seed(cohort_seed)
    return config.load(ProbeConfig, "configs/probe.yaml",
                       [f"cache={cache_dir}", f"bootstrap={n_boot}", "per_scanner=false", "cross_scanner=false",
                        "baselines=true", f"baseline_draws={random_draws}", f"device={device}",
                        *(() if draws_from is None else (f"baseline_seed={draws_from}",)), *probe_args])


def finetune_config(ckpt: str, cache: str, out, init: str, fraction: float, seed: int, device: str,
                    *args: str) -> FinetuneConfig:
    """configs/finetune.yaml as users run it, for one of the check's fine-tuning runs on the binary task:
    bf16 on cuda, fp32 elsewhere; `args` override any key."""
    return config.load(FinetuneConfig, "configs/finetune.yaml",
                       [f"ckpt={ckpt}", f"cache={cache}", f"out={out}", f"init={init}", f"label_fraction={fraction}",
                        f"seed={seed}", f"task={BINARY}", f"device={device}",
                        f"precision={'bf16' if device == 'cuda' else 'fp32'}", *args])


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
    cfg = finetune_config(ckpt, cache, out / tag, init, fraction, seed, device, f"bootstrap={n_boot}",
                            *(FULL_LABEL_BUDGET if fraction == 1.0 else ()),
                            *(() if train_seed is None else (f"train_seed={train_seed}",)), *args)
    ft = finetune.Finetuner(cfg, runtime.setup(cfg.device, cfg.precision))
    if [r["relpath"] for r in ft.rows] != [r["relpath"] for r in rows]:
        raise RuntimeError(f"{out / tag}: fine-tuning read other rows than the probes")  # cannot pair them
    res = ft.run(progress=progress)
    top = res["probes"][0]
    return Tuned(res["prob"], {"fraction": fraction, "init": init, "train_seed": train_seed, "head": top["head"],
                               "best_epoch": top["best_epoch"],
                               "best_step": top.get("best_step"), "epochs_run": res["epochs_run"],
                               "steps_run": ft.step, "val_every": cfg.val_every, "patience": cfg.patience,
                               "val": [round(h["balanced_accuracy"], 4) for h in res["history"]]},
                 res["best_checkpoint"])


def job_name(init: str, fraction: float, train_seed: int | None = None) -> str:
    """A fine-tuning run's job and stage name: one per run the check trains (pct is exact: 0.1 and 0.104
    are two), or one would take the other's place among the jobs. `train_seed`: said from the second run on."""
    seed = "" if train_seed is None else f", training seed {train_seed}"
    return f"fine-tuning ({init} init{seed}), {pct(fraction)} of labels"


def check(cfg: CheckConfig) -> dict:
    """The whole check for one cue; every stage reuses what an earlier run finished. The supervised
    references are `make finetune` from random init at cfg.reference_fractions: the very runs the
    fine-tuning rows set the checkpoint against (one run where both want it)."""
    spec, work, out, n_boot = CUES[cfg.cue], Path(cfg.work), Path(cfg.out), cfg.bootstrap
    config_path, overrides = cfg.pretrain_config, cfg.overrides
    stages, generated, source = Stages(), cfg.source is None, cfg.source
    device = eval_device(config.load(TrainConfig, config_path, overrides).device)  # refuse bad ARGS before any work
    home = work / f"{spec.cohort_name}_seed{cfg.seed}"
    cache_dir = home / "cache" if generated else work / ("cache_" + hashlib.sha256(source.encode()).hexdigest()[:8])
    cohort_seed = cfg.seed if generated else None  # the cohort's own training seeds and random-init draws
    pcfg = probe_config(cache_dir, n_boot, cfg.draws, device, cfg.probe, cohort_seed)  # bad --probe keys: before work
    dest = out / cfg.cue
    if set_aside_results(dest):  # an earlier run's: never beside this run's interim result (a run cut short)
        print(f"learning-check: moved the earlier run's result files to {dest / 'previous'}/", flush=True)
    if generated:
        cohort_cfg = dataclasses.replace(spec.cohort, seed=cfg.seed, participants=cfg.participants)
        source = stages.run("cohort", lambda: cohort(home / "source", cohort_cfg))
    cache = stages.run("cache", lambda: build_cache(source, cache_dir))
    run_dir = stages.run("pretrain", lambda: pretrain_run(config_path, cache, out, overrides))
    ckpt = checkpoint.newest_whole(RunFolder(run_dir).checkpoints())
    probe_dir = RunFolder(run_dir).probe
    reads_tokens = spec.protocol == "splits" and (Path(source) / synth.LESION_TABLE).exists()  # the token probe runs
    grids = ("pretrained", probe.random_draw(1)) if reads_tokens else ()  # its two encoders' tokens, in this pass
    f = stages.run("features", lambda: probe.checkpoint_features(pcfg, ckpt, probe_dir, grids=grids))
    t_seeds = training_seeds(cohort_seed, pcfg.seed, cfg.finetune_seeds)  # the fine-tuning runs' and references'
    about = {"cue": cfg.cue, "size": cfg.size, "commit": git_commit(Path(__file__).resolve().parents[1]),
             "what": spec.what, "protocol": spec.protocol, "target": spec.target,
             "source": source, "cohort_seed": cohort_seed,
             "cache": cache, "run": str(run_dir), "ckpt": ckpt, "step": f["step"],
             "objective": objective(config.load(TrainConfig, config_path, overrides).loss),
             "overrides": list(overrides), "bootstrap": n_boot, "features_reused": f["reused"],
             "training_seeds": t_seeds, "probe_standardize": pcfg.standardize, "random_draws": pcfg.baseline_draws,
             "random_init_seeds": probe.draw_seeds(pcfg)}
    head = stages.run("headline probes", lambda: interim(about, pcfg, f, n_boot, dest, cfg.threads))
    ref_fracs, tune_keys, run_keys = planned_runs(cfg, spec.protocol == "splits")
    runs = {key: (job_name(key[1], key[0], None if key[2] == 0 else t_seeds[key[2]]),
                  (finetuned, (ckpt, cache, RunFolder(run_dir).root / "finetune", f["rows"], key[1], key[0], pcfg.seed,
                               n_boot, cfg.tuning_args, device, t_seeds[key[2]], cfg.threads is None)))
            for key in run_keys}  # each job a module-level function and its arguments: it can run in its own process
    done = train_runs(stages, cfg.threads, runs, pcfg, f, head)
    sup, sup_training = supervised(stages, pcfg, {frac: done[runs[(frac, "random", 0)][0]] for frac in ref_fracs},
                                   probe_dir)
    tuned = {}
    for frac, init, k in tune_keys:
        tuned.setdefault(frac, {}).setdefault(init, []).append(done[runs[(frac, init, k)][0]].prob)
    scores = stages.run("probes", lambda: probe_all(pcfg, f["rows"], f["feats"], sup, spec.protocol, FRACTIONS, n_boot,
                                                    tuned, head, done.get(CURVE_JOB)))
    result = {**about, **scores, "supervised_reference": scores.get("supervised_reference", {}),
              "supervised_training": sup_training, "finetune_args": list(cfg.tuning_args),
              "training": training_summary(run_dir), "online_probe": online_curve(run_dir), "stages": stages.times}
    if spec.protocol == "scanners":
        result["pretraining"] = TRANSDUCTIVE
    add_verdicts(result, [done[runs[key][0]].run for key in tune_keys])
    if reads_tokens:  # a generated cohort's answer key
        # every row but the token probe's first: a lent GPU's call cut in the token probe keeps them
        write_result({**result, "verdict": f"{BEFORE_TOKENS}: {result['verdict']}"}, dest, "result_interim")
        tokens = stages.run("token probe", lambda: token_probe.run(
            ckpt, source, probe_dir / "tokens", cache, pcfg.seed, device=device, batch=pcfg.extract_batch,
            features_dir=probe_dir / "features", precision=f["precision"], random_seed=probe.draw_seeds(pcfg)[0]))
        result["token_probe"] = {**tokens, "line": token_probe.line(tokens)}
    write_result(result, dest, "result")
    plot(result, dest / "result.png")
    return result


def planned_runs(cfg: CheckConfig, splits: bool) -> tuple[list, list, list]:
    """(the reference fractions, largest first; the fine-tuning runs' (fraction, init, training seed index);
    every run to train, largest fraction first). A reference is the from-scratch run at its fraction (training
    seed index 0): one run where both want it. Held-out scanners (`splits` False): none."""
    if not splits:
        return [], [], []
    ref_fracs = sorted(cfg.reference_fractions, reverse=True)
    tune_keys = [(frac, init, k) for frac in sorted(cfg.finetune_fractions) for init in ("pretrained", "random")
                 for k in range(cfg.finetune_seeds)]
    run_keys = sorted({*tune_keys, *((frac, "random", 0) for frac in ref_fracs)}, key=lambda t: (-t[0], t[1], t[2]))
    return ref_fracs, tune_keys, run_keys


def train_runs(stages: Stages, threads: int | None, runs: dict, pcfg: ProbeConfig, f: dict, head: dict) -> dict:
    """{job name: its result} of the references' and fine-tuning runs (`runs`: key -> (name, job)): each in its
    own process, at once, with the curve's own heads first (they need no reference; a short job the probes
    stage waits on, so it does not queue behind long ones), or one after another (`threads` None)."""
    jobs = dict(runs.values())
    if threads is None or not jobs:
        return {name: stages.run(name, lambda job=job: call_job(job)) for name, job in jobs.items()}
    mine = {e: f["feats"][e] for e in ("pretrained", *probe.random_draws(f["feats"]))}
    jobs = {CURVE_JOB: (curve_fits, (pcfg, f["rows"], mine, head["folds"], FRACTIONS)), **jobs}
    return stages.together("references and fine-tuning", jobs, threads)


def supervised(stages: Stages, pcfg: ProbeConfig, refs: dict, probe_dir: Path) -> tuple[dict, dict]:
    """The supervised references' frozen features ({fraction: features}) and how each trained ({pct: ...}),
    from their runs (`refs`: {fraction: Tuned}); empty without references."""
    if not refs:
        return {}, {}
    read = stages.run("supervised features", lambda: supervised_features(
        pcfg, {frac: r.ckpt for frac, r in refs.items()}, probe_dir))
    return read, {pct(frac): reference_training(refs[frac].run) for frac in read}


def add_verdicts(result: dict, tuned_runs: list[dict]) -> None:
    """Each question's verdict into `result`: does pretraining learn (the headline), label efficiency (where a
    reference was trained), fine-tuning (where run, with its runs' records)."""
    result["verdict"] = verdict(result)
    efficiency = label_efficiency_verdict(result)
    if efficiency:
        result["label_efficiency"]["verdict"] = efficiency
    if "finetune" in result:
        result["finetune"]["runs"] = tuned_runs
        result["finetune"]["verdict"] = finetune_verdict(result["finetune"]["points"])
        result["finetune"]["against_supervised"] = finetune_against_supervised(result["finetune"]["points"])

CURVE_JOB = "label-efficiency heads, pretrained and random init"
BEFORE_TOKENS = "INTERIM, every row but the token probe's"
INTERIM = ("INTERIM, before the supervised references, label efficiency, fine-tuning and token probe "
           "(result.json has them when the check ends)")


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


def command_line(argv: Sequence[str] | None = None) -> CheckConfig | str:
    """The command line as a CheckConfig (each flag a key of it; `--set KEY=VALUE` any key, last),
    or `--line`'s run folder."""
    ap = argparse.ArgumentParser(prog="make learning-check", description=__doc__, argument_default=argparse.SUPPRESS)
    ap.add_argument("--source", help="AI-READI-shaped dataset root with labels (default: the generated cohort)")
    ap.add_argument("--work", help="where the cohort and its cache go (default data/learning_check)")
    ap.add_argument("--out", help="the runs and <out>/<cue>/result.* (default runs/learning_check)")
    ap.add_argument("--size", choices=list(SIZES),
                    help="the check's size (make SIZE=...): cpu (default), or gpu for one H100/H200")
    ap.add_argument("--config", help="the pretraining config (default: the size's)")
    ap.add_argument("--cue", choices=list(CUES), help="the kind of class cue (make CUE=...; default lesions)")
    ap.add_argument("--seed", type=int, help="the generated cohort's seed (make SEED=...)")
    ap.add_argument("--participants", type=int, help="the generated cohort's size")
    ap.add_argument("--bootstrap", type=int, help="participant resamples of every interval")
    ap.add_argument("--probe", action="append", metavar="KEY=VALUE", help="a probe config override (key=value; repeatable)")
    ap.add_argument("--label-efficiency", action="store_true",
                      help="ask the label-efficiency question: a supervised reference (make finetune from random init) "
                           "at 10%% of labels (make LABELS=1; about 22 more minutes on 2 cores)")
    ap.add_argument("--curve", action="store_true",
                    help="a supervised reference at every fraction of the curve, 10, 25 and 100%% (make CURVE=1)")
    ap.add_argument("--finetune", action="store_true",
                    help="also fine-tune the checkpoint and a random-init encoder end to end (make finetune) on "
                         f"{' and '.join(pct(f) for f in FINETUNE_FRACTIONS)} of labels (make FINETUNE=1)".replace("%", "%%"))
    ap.add_argument("--finetune-fraction", dest="finetune_fractions", action="append", type=float, metavar="FRACTION",
                    help="fine-tune on this label fraction only (repeatable; implies --finetune)")
    ap.add_argument("--finetune-arg", dest="finetune_args", action="append", metavar="KEY=VALUE",
                    help="a fine-tuning config override (key=value; repeatable)")
    ap.add_argument("--finetune-seeds", type=int,
                    help="training seeds per init on the same participants; rows are their mean (make FT_SEEDS=...)")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="train the references and fine-tuning runs one after another, not each in its own process")
    ap.add_argument("--set", dest="keys", action="append", metavar="KEY=VALUE",
                    help="any CheckConfig key (check/config.py), after the flags: e.g. random_draws=1 (default: the "
                         "size's, " + ", ".join(f"{k} {v.random_draws}" for k, v in SIZES.items()) + ")")
    ap.add_argument("--line", metavar="RUN", help="only print the one-line comparison from RUN/probe (no work)")
    ap.add_argument("overrides", nargs="*", help="pretraining config overrides (make ARGS)")
    flags = vars(ap.parse_intermixed_args(argv))
    if "line" in flags:
        return flags["line"]
    keys = config.parse_overrides(flags.pop("keys", []), "--set")
    if flags.pop("label_efficiency", False):
        flags["reference_fractions"] = (min(FRACTIONS),)
    if flags.pop("curve", False):  # the whole curve holds the 10% reference too
        flags["reference_fractions"] = FRACTIONS
    if flags.pop("finetune", False):
        flags.setdefault("finetune_fractions", FINETUNE_FRACTIONS)
    if flags.pop("one_at_a_time", False):
        flags["together"] = False
    return config.from_dict(CheckConfig, config.merge(flags, keys), where="make learning-check")


def main(argv: Sequence[str] | None = None) -> int:
    cfg = command_line(argv)
    if isinstance(cfg, str):
        print(probe_line(RunFolder(cfg).probe))
        return 0
    t0 = time.perf_counter()
    r = check(cfg)
    print(markdown(r))
    print(f"learning-check: wrote {Path(cfg.out) / cfg.cue}/result.json, result.md, result.png in "
          f"{time.perf_counter() - t0:.0f}s")
    print("\n".join(verdict_lines(r)))
    return 0


if __name__ == "__main__":
    cli.run(main)
