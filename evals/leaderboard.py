"""`make leaderboard RUN=runs/a [RUNS="runs/b ..."]`: probe a run's checkpoints and rank them.

A `make finetune` run folder among them contributes its report (best val epoch, on test) as is.
A run is a local run folder or a gs:// one as a TPU run leaves it (train/run_folder.py); what the
leaderboard writes goes to the run's local folder (a gs:// run's: runs/<name>).

The self-supervised loss says little about representation quality, so checkpoints are
chosen by downstream score. A bounded set of each run's step_<N>.pt (`max_checkpoints`, evenly
spaced, the newest always among them: `bounded_steps`; latest.pt names the newest, so it is not probed
again), stated with the estimated time before the first probe, goes through the same
per-checkpoint probe as `make probe`, features extracted once per checkpoint and kept. Each checkpoint's result is stored as
<run>/probe/leaderboard/step_<N>.json with the checkpoint's identity (name, size, modification
time), the probe settings and a fingerprint of the labelled cache rows: a re-run probes only
new or changed checkpoints. The table has one row per run, checkpoint and task (the head
chosen on val); per run and task the best checkpoint is chosen on val only, reported on test
and recorded in <run>/best_checkpoint.json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Sequence

import pandas as pd
import pyarrow as pa
from tqdm import tqdm

from evals import features, probe
from evals.config import ProbeConfig
from octfm import cli, config, fsio, plots
from train import checkpoint, run_folder, runtime, shares
from train.config import saved_config
from train.metrics import read_splits
from train.run_folder import RunFolder

LEADERBOARD_VERSION = "1"
# What makes a checkpoint's stored result (probe.probe_checkpoint: features, heads, scores): its import closure keys
# the result with the settings (config.code_key), so rows made by older code are probed afresh, not mixed in
RESULT_CODE = ("evals/probe.py",)
# Baselines do not change with the checkpoint and cross-device transfer multiplies the probe
# time by the number of scanners: off unless ARGS turns them back on (`make probe` has both).
DEFAULTS = ["baselines=false", "cross_scanner=false"]
# ProbeConfig keys that do not change a checkpoint's result (where it comes from, where it runs, which are probed).
NOT_IN_KEY = ("run", "ckpt", "device", "extract_batch", "max_checkpoints")
METRICS = (("balanced_accuracy", "balanced_accuracy"), ("auroc", "auroc_macro_ovr"))
VAL_COLUMNS = ["val_balanced_accuracy", "val_auroc"]


# ProbeConfig keys added after results were stored: left out of the key while they hold their default (None),
# so a stored result stays valid (the leaderboard probes without random-init baselines anyway)
ADDED_LATER = ("baseline_seed",)


def result_settings(cfg: ProbeConfig) -> dict:
    """The probe settings a checkpoint's result depends on."""
    return {k: v for k, v in config.to_dict(cfg).items()
            if k not in NOT_IN_KEY and not (k in ADDED_LATER and v is None)}


def settings_key(cfg: ProbeConfig) -> str:
    blob = {**result_settings(cfg), "version": LEADERBOARD_VERSION, "code": config.code_key(RESULT_CODE)}
    return config.content_key(blob, 16)


def stored_path(run: str, step: int) -> Path:
    return RunFolder(run_folder.local_folder(run)).stored_result(step)


def bounded_steps(steps: list[int], most: int) -> list[int]:
    """At most `most` of the saved steps, evenly spaced over them with the first and the newest
    among them (every Nth and the last); all of them when `most` is 0 or they are no more."""
    if not most or len(steps) <= most:
        return list(steps)
    if most == 1:
        return [steps[-1]]
    return sorted({steps[round(i * (len(steps) - 1) / (most - 1))] for i in range(most)})


def _load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Board:
    """Stored results of one or more runs; decides which checkpoints still need a probe."""

    def __init__(self, cfg: ProbeConfig):
        self.cfg, self.key = cfg, settings_key(cfg)
        self._fingerprints: dict[str, str] = {}
        self.left_out: dict[str, int] = {}  # per run: saved checkpoints outside the bounded set

    def fingerprint(self, cache: str) -> str:
        if cache not in self._fingerprints:
            rows = probe.labelled_rows(cache, self.cfg.seed, self.cfg.shuffle_labels)
            self._fingerprints[cache] = probe.rows_fingerprint(rows)
        return self._fingerprints[cache]

    def fresh(self, rec: dict | None, ident: dict | None) -> bool:
        """A stored result still holds: same settings, same checkpoint file, same cache rows."""
        if not rec or rec.get("settings_key") != self.key:
            return False
        if ident is not None and rec.get("ckpt_identity") != ident:
            return False
        res = rec["result"]
        return self.fingerprint(res["cache"]) == res["rows_fingerprint"]

    def plan(self, run: str) -> tuple[dict[int, dict], list[tuple[int, str, dict]]]:
        """(stored results that hold, by step; checkpoints to probe as (step, uri, identity)): the
        bounded set (`max_checkpoints`), and any other step already probed."""
        ckpt_dir = probe.run_checkpoint_dir(run)
        steps = checkpoint.list_steps(ckpt_dir)
        chosen = set(bounded_steps(steps, self.cfg.max_checkpoints))
        stored = {rec.get("step"): rec for path in sorted(RunFolder(run_folder.local_folder(run)).stored_results_dir
                                                          .glob("step_*.json")) if (rec := _load_json(path))}
        done, todo = {}, []
        self.left_out[run] = len(steps) - len(chosen)
        for step in steps:
            rec = stored.get(step)
            if step not in chosen and rec is None:
                continue
            uri = checkpoint.step_uri(ckpt_dir, step)
            ident = checkpoint.identity(uri)
            if self.fresh(rec, ident):
                done[step] = {**rec, "ckpt": uri, "ckpt_exists": True}
            elif step not in chosen:
                continue
            elif checkpoint.is_whole(uri):
                todo.append((step, uri, ident))
            else:  # being written by a live run, or torn: a later call probes it when whole
                print(f"leaderboard: skipping {uri}: cut short (no ZIP directory)", file=sys.stderr)
        # a pruned checkpoint (keep_last) keeps its place on the board, but cannot be chosen
        for step, rec in stored.items():
            if step not in steps and self.fresh(rec, None):
                done[step] = {**rec, "ckpt_exists": False}
        return done, todo

    def probe(self, run: str, step: int, uri: str, ident: dict) -> dict:
        t0 = time.perf_counter()
        res = probe.probe_checkpoint(self.cfg, uri, RunFolder(run_folder.local_folder(run)).probe, reports=False)
        self._fingerprints.setdefault(res["cache"], res["rows_fingerprint"])
        rec = {"step": step, "ckpt": uri, "ckpt_identity": ident, "settings_key": self.key,
               "settings": result_settings(self.cfg), "probed_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "seconds": round(time.perf_counter() - t0, 1), "result": res}
        fsio.atomic_write_bytes(str(stored_path(run, step)), json.dumps(rec, indent=1, default=float).encode())
        return {**rec, "ckpt_exists": True}


def _scores(prefix: str, m: dict, suffix: str = "") -> dict:
    out = {}
    for name, key in METRICS:
        lo, hi = m.get(f"{key}_ci95") or (None, None)
        out.update({f"{prefix}_{name}{suffix}": m[key], f"{prefix}_{name}_ci95_lo{suffix}": lo,
                    f"{prefix}_{name}_ci95_hi{suffix}": hi})
    return out


def _at_step(records: dict[int, dict], step: int, exact: bool = False) -> dict:
    """The metrics record logged at `step`, else (unless exact) the last one before it."""
    if step in records:
        return records[step]
    before = [s for s in records if s <= step]
    return records[max(before)] if before and not exact else {}


def head_columns(p: dict) -> dict:
    """A chosen head's columns: its settings, val and test scores with intervals."""
    return {"head": p["head"], "lr": p["lr"], "weight_decay": p["weight_decay"], "n_val": p["val"]["n"],
            "n_test": p["test"]["n"], **_scores("val", p["val"]), **_scores("test", p["test"]),
            "test_collapsed": p["test"]["collapsed"]}


def scanner_columns(per_scanner: dict) -> dict:
    """Its test scores per scanner (`...@<device>` columns, named by the manifest's device value)."""
    out = {}
    for device, m in per_scanner.items():
        out.update({f"test_n@{device}": m["n"], **_scores("test", m, f"@{device}")})
    return out


def table_rows(run: str, records: list[dict]) -> list[dict]:
    """One row per checkpoint and task: the pretrained encoder's head chosen on val, its val
    and test scores with intervals, per test device, and the pretraining metrics at that step
    (a gs:// run's from the metrics its trainer copied there)."""
    splits = read_splits(run_folder.local_folder(run)) or read_splits(run)
    train_m, val_m, probe_m = (splits.get(k, {}) for k in ("train", "val", "probe"))
    rows = []
    for rec in records:
        tr, va = _at_step(train_m, rec["step"]), _at_step(val_m, rec["step"], exact=True)
        online = _at_step(probe_m, rec["step"])  # the last online probe at or before the checkpoint
        for task, res in rec["result"]["results"].items():
            heads = [p for p in res["probes"] if p["encoder"] == "pretrained"]
            p = max(heads, key=lambda h: probe.val_rank(h["val"]["balanced_accuracy"], h["val"]["auroc_macro_ovr"]))
            row = {"run": str(run), "run_name": Path(run).name, "step": rec["step"], "task": task,
                   "ckpt": rec["ckpt"], "ckpt_exists": rec["ckpt_exists"], **head_columns(p),
                   "pretrain_logged_step": tr.get("step"), "pretrain_loss": tr.get("loss"),
                   "pretrain_rankme": tr.get("rankme"), "pretrain_target_std": tr.get("target_std"),
                   "pretrain_val_loss": va.get("loss"), "online_probe_step": online.get("step"),
                   "online_knn_bal_acc": online.get(f"{task}/knn_bal_acc"),
                   **scanner_columns(res["per_scanner"].get(p["head"], {}))}
            rows.append(row)
    return rows


def finetune_table_rows(run: str) -> list[dict]:
    """A `make finetune` run folder's rows: its task report (the best val epoch, scored on test),
    nothing probed; columns as table_rows writes them (the pretraining ones empty)."""
    folder = RunFolder(run)
    best = folder.finetuned()
    rows = []
    for path in sorted(folder.root.glob("*/metrics.json")):
        res = json.loads(path.read_text())
        p = res["probes"][0]
        row = {"run": str(run), "run_name": Path(run).name, "step": p["best_epoch"], "task": res["task"], "ckpt": best,
               "ckpt_exists": Path(best).exists(), **head_columns(p), "head": f"{p['encoder']} {p['head']}",
               **scanner_columns(res["per_scanner"].get(p["head"], {}))}
        rows.append(row)
    return rows


def select_best(table: pd.DataFrame) -> pd.DataFrame:
    """Per run and task, the checkpoint still on disk with the best val balanced accuracy
    (ties: val AUROC, then the earliest step). Only val columns reach the ranking."""
    view = table.loc[table["ckpt_exists"], ["run", "task", "step", *VAL_COLUMNS]]
    ranks = pd.DataFrame([probe.val_rank(ba, au) for ba, au in zip(view[VAL_COLUMNS[0]], view[VAL_COLUMNS[1]])],
                         index=view.index, columns=["_ba", "_au"])
    order = view.join(ranks).sort_values(["_ba", "_au", "step"], ascending=[False, False, True], kind="stable")
    return table.loc[order.groupby(["run", "task"], sort=False).head(1).index]


def _num(v) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def write_best(run: str, best: pd.DataFrame, cfg: ProbeConfig) -> Path:
    """<run>/best_checkpoint.json (a gs:// run's in its local folder): the choice per task."""
    tasks = {}
    for _, r in best[best["run"] == str(run)].iterrows():
        tasks[r["task"]] = {"step": int(r["step"]), "ckpt": r["ckpt"], "head": r["head"], "lr": r["lr"],
                            "weight_decay": r["weight_decay"],
                            **{c: _num(r[c]) for c in r.index if c.startswith(("val_", "test_")) and "@" not in c
                               and c != "test_collapsed"},
                            "pretrain_loss": _num(r.get("pretrain_loss")), "pretrain_rankme": _num(r.get("pretrain_rankme"))}
    out = RunFolder(run_folder.local_folder(run)).best_checkpoint
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"selected_on": "val", "rule": "highest val balanced accuracy of the head chosen on val; ties: val AUROC, "
           "then the earliest step; test scores are reported, never used", "settings_key": settings_key(cfg),
           "probe_settings": result_settings(cfg), "tasks": tasks}
    fsio.atomic_write_bytes(str(out), json.dumps(doc, indent=2).encode())
    return out


def _fmt(row, split: str, metric: str, device: str = "") -> str:
    """`value [lo, hi]` from a table row (device: the per-device columns, `...@<device>`)."""
    at = f"@{device}" if device else ""
    return cli.fmt_number(_num(row[f"{split}_{metric}{at}"]), [_num(row[f"{split}_{metric}_ci95_lo{at}"]),
                                                           _num(row[f"{split}_{metric}_ci95_hi{at}"])])


def devices_of(table: pd.DataFrame) -> list[str]:
    return sorted({c.split("@", 1)[1] for c in table.columns if c.startswith("test_balanced_accuracy@")})


def markdown(table: pd.DataFrame) -> str:
    lines = ["# Checkpoint leaderboard", "",
             "One row per run, checkpoint and task: the pretrained encoder's head chosen on val (balanced accuracy, "
             "then AUROC). Intervals: 95% bootstrap over participants. `best`: per run and task, chosen on val only "
             "and reported on test. Loss and RankMe: pretraining metrics logged at that step; online k-NN: the "
             "online probe's val balanced accuracy at or before that step. A fine-tuning run (`make finetune`, head "
             "`finetuned_...`): its step is the best val epoch.", ""]
    devices = devices_of(table)
    for task, t in table.groupby("task", sort=False):
        lines += [f"## {task}", "", "| run | step | head | val bal. acc | val AUROC | test bal. acc | test AUROC | "
                  "loss | RankMe | online k-NN | best |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for _, r in t.iterrows():
            lines.append(f"| {r['run_name']} | {r['step']} | {r['head']} | {_fmt(r, 'val', 'balanced_accuracy')} | "
                         f"{_fmt(r, 'val', 'auroc')} | {_fmt(r, 'test', 'balanced_accuracy')} | "
                         f"{_fmt(r, 'test', 'auroc')} | {cli.fmt_number(_num(r.get('pretrain_loss')))} | "
                         f"{cli.fmt_number(_num(r.get('pretrain_rankme')))} | "
                         f"{cli.fmt_number(_num(r.get('online_knn_bal_acc')))} | {'**best**' if r['best'] else ''}"
                         f"{'' if r['ckpt_exists'] else ' (pruned)'} |")
        if devices:
            lines += ["", f"Per test device ({task}): balanced accuracy / AUROC [95% CI]", "",
                      "| run | step | " + " | ".join(devices) + " |", "|---" * (len(devices) + 2) + "|"]
            for _, r in t.iterrows():
                cells = [f"{_fmt(r, 'test', 'balanced_accuracy', d)} / {_fmt(r, 'test', 'auroc', d)}"
                         if pd.notna(r.get(f"test_n@{d}")) else "n/a" for d in devices]
                lines.append(f"| {r['run_name']} | {r['step']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(table: pd.DataFrame, out: Path) -> None:
    """Score against training step: a column per task, balanced accuracy and AUROC rows; per
    run one colour, val solid, test dashed with its interval shaded, the chosen checkpoint starred."""
    plt = plots.pyplot()
    from matplotlib.ticker import MaxNLocator

    tasks = list(dict.fromkeys(table["task"]))
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks), 7), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, task in enumerate(tasks):
        for i, (metric, title) in enumerate((("balanced_accuracy", "balanced accuracy"), ("auroc", "AUROC"))):
            ax = axes[i, j]
            for c, (run, t) in enumerate(table[table["task"] == task].groupby("run", sort=False)):
                t = t.sort_values("step")
                col, name = colors[c % len(colors)], t["run_name"].iloc[0]
                ax.plot(t["step"], t[f"val_{metric}"], "o-", color=col, label=f"{name} val")
                ax.plot(t["step"], t[f"test_{metric}"], "s--", color=col, label=f"{name} test")
                lo, hi = t[f"test_{metric}_ci95_lo"].astype(float), t[f"test_{metric}_ci95_hi"].astype(float)
                ax.fill_between(t["step"], lo, hi, color=col, alpha=0.12)
                b = t[t["best"]]
                ax.plot(b["step"], b[f"val_{metric}"], "*", color=col, markersize=16, markeredgecolor="k")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(f"{task}: {title}")
            ax.set_xlabel("training step")
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.suptitle("checkpoint leaderboard (star: chosen on val)")
    fig.tight_layout()
    plots.save_png(fig, out, dpi=80)


def default_out(runs: list[str]) -> Path:
    """One run: its (local) folder. Several: a `leaderboard` folder beside the first."""
    first = run_folder.local_folder(runs[0])
    return first if len(runs) == 1 else first.parent / "leaderboard"


def estimate_line(cfg: ProbeConfig, todo: list[tuple[str, int, str, dict]]) -> str:
    """What the probes will take, said before the first: a feature pass of the first checkpoint's
    architecture over the labelled rows, timed on one batch of them (after one to warm up) on the
    probes' device and scaled to all, times the checkpoints to probe; the heads are not counted."""
    run, _, uri, _ = todo[0]
    saved = run_folder.stored_config(run_folder.checkpoint_dir(run)) or run_folder.stored_config(run)
    if saved:
        tcfg = saved_config(saved, uri)
        enc = features.checkpoint_encoder(None, train_cfg=tcfg)[0]
    else:
        enc, tcfg, _ = features.checkpoint_encoder(uri)
    cache = cfg.cache or shares.whole_cache(tcfg.data.cache, "leaderboard")
    rows = probe.labelled_rows(cache, cfg.seed, cfg.shuffle_labels)
    device, b = runtime.device_for(cfg.device), cfg.extract_batch
    if len(rows) < 2 * b:
        return f"leaderboard: {len(todo)} checkpoint(s) of {len(rows)} labelled volumes each on {device}"
    features.extract(enc, tcfg, rows[:b], cache, cfg.token_pool, device, b)   # warm-up (first call, compile)
    t0 = time.perf_counter()
    features.extract(enc, tcfg, rows[b:2 * b], cache, cfg.token_pool, device, b)
    per = (time.perf_counter() - t0) / b * len(rows)
    return (f"leaderboard: ESTIMATE {len(todo)} checkpoint(s) x a feature pass over {len(rows)} labelled volumes on "
            f"{device} of about {per / 60:.1f} min (one batch of {b} timed) = about {len(todo) * per / 3600:.2f} h, "
            f"plus the heads' training (not estimated); less where a checkpoint's features are kept")


def run(runs: Sequence[str], cfg: ProbeConfig, out: str | Path | None = None, progress: bool = True) -> dict:
    runs = list(dict.fromkeys(str(r).rstrip("/") for r in runs))
    probe.check_tasks(cfg)
    board = Board(cfg)
    done, todo = {}, []
    tuned = {r: finetune_table_rows(r) for r in runs  # reports, nothing to probe
             if not run_folder.is_remote_run(r) and RunFolder(r).finetune.exists()}
    for r in runs:
        if not (fsio.exists(r) if run_folder.is_remote_run(r) else Path(r).is_dir()):
            raise cli.UsageError(f"run: no run folder {r}")
        if r in tuned:
            if not tuned[r]:
                raise cli.UsageError(f"run: the fine-tuning run {r} has no report yet (let `make finetune` finish)")
            continue
        done[r], t = board.plan(r)
        if not t and not done[r]:
            raise cli.UsageError(f"run: no step_<N>.pt checkpoint under {probe.run_checkpoint_dir(r)}")
        todo += [(r, *x) for x in t]
        if r not in tuned:
            print(f"leaderboard: {r}: {len(done[r]) + len(t)} checkpoint(s) on the board, {len(t)} to probe"
                  + (f"; {board.left_out[r]} more saved, left out by max_checkpoints={cfg.max_checkpoints} (evenly "
                     f"spaced, the newest among them; 0 probes every one)" if board.left_out[r] else ""))
    if todo:
        print(estimate_line(cfg, todo))
    bar = tqdm(todo, desc="leaderboard", unit="ckpt", disable=not progress or not todo, file=sys.stderr)
    for r, step, uri, ident in bar:
        bar.set_postfix_str(f"{Path(r).name} step {step}")
        done[r][step] = board.probe(r, step, uri, ident)
    table = pd.DataFrame([row for r in runs for row in (tuned[r] if r in tuned else
                                                        table_rows(r, [done[r][s] for s in sorted(done[r])]))])
    best = select_best(table)
    table["best"] = table.index.isin(best.index)
    best_files = [str(write_best(r, best, cfg)) for r in runs]
    out = Path(out) if out else default_out(runs)
    out.mkdir(parents=True, exist_ok=True)
    fsio.write_parquet_atomic(pa.Table.from_pandas(table, preserve_index=False), str(run_folder.leaderboard_file(out, "parquet")))
    fsio.atomic_write_bytes(str(run_folder.leaderboard_file(out, "md")), markdown(table).encode())
    plot(table, run_folder.leaderboard_file(out, "png"))
    return {"table": table, "best": table[table["best"]], "probed": [(r, s) for r, s, _, _ in todo],
            "reused": sum(len(d) for d in done.values()) - len(todo), "out": str(out), "best_files": best_files}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make leaderboard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", help="a pretraining run folder (repeat for several); "
                                                   "default: the config's `run`")
    ap.add_argument("--config", default=None, help="probe settings (configs/probe.yaml)")
    ap.add_argument("--out", default=None, help="where the table goes (default: the run folder, or "
                                                "<parent>/leaderboard for several runs)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("overrides", nargs="*", help="ProbeConfig key=value overrides (make ARGS)")
    a = ap.parse_args(argv)
    cfg = config.load(ProbeConfig, a.config, [*DEFAULTS, *a.overrides])
    runs = a.run or ([cfg.run] if cfg.run else [])
    if not runs:
        raise cli.UsageError("leaderboard: give a run (RUN=runs/<name> or --run) or set `run` in the config")
    t0 = time.perf_counter()
    res = run(runs, cfg, a.out, progress=not a.no_progress)
    table = res["table"]
    for task, t in table.groupby("task", sort=False):
        rows = [(r["run_name"], r["step"], r["head"], _fmt(r, "val", "balanced_accuracy"),
                 _fmt(r, "test", "balanced_accuracy"), cli.fmt_number(_num(r["test_auroc"])),
                 cli.fmt_number(_num(r.get("pretrain_loss"))), cli.fmt_number(_num(r.get("pretrain_rankme"))),
                 "<- best" if r["best"] else "") for _, r in t.iterrows()]
        print(f"\n{task}:")
        print(cli.format_table(["run", "step", "head", "val bal. acc [95% CI]", "test bal. acc [95% CI]",
                                "test AUROC", "loss", "RankMe", ""], rows))
    print()
    for _, r in res["best"].iterrows():
        print(f"best {r['run_name']} {r['task']}: step {r['step']} (val bal. acc "
              f"{cli.fmt_number(_num(r['val_balanced_accuracy']))}, test {_fmt(r, 'test', 'balanced_accuracy')}) {r['ckpt']}")
    probed = ", ".join(f"{Path(r).name}@{s}" for r, s in res["probed"]) or "none"
    print(f"leaderboard: probed {len(res['probed'])} checkpoint(s) ({probed}), reused {res['reused']} stored; "
          f"table {res['out']}/leaderboard.parquet, .md, .png; choices {', '.join(res['best_files'])}; "
          f"{time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    cli.run(main)
