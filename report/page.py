"""`make report CACHE=... [RUN=...]`: one HTML page showing what the pipeline did.

A flipped orientation, a wrong window or a collapsed run is obvious in a picture and
invisible in a log. The page shows the cache (counts, failure reasons, shapes, a central
B-scan and an en-face projection of random volumes per device and protocol, intensity
histograms of the source before and of the cache after the window) and, for a run, the
training curves from metrics.jsonl and the probe results.

One file: every PNG is embedded as a base64 data URI, so the page can be mailed, attached
to an issue or copied off a TPU VM on its own. Every string read from a manifest or a run
(paths, error messages, probe reports) is HTML-escaped: they come from untrusted files.
It is its own top-level package because it reads the outputs of every stage; no stage
imports it.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import json
import math
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
from tqdm import tqdm

from cache import store
from ingest import dicom
from ingest.preprocess import subsample
from manifests import paths, schema
from octfm import cli, fsio, plots
from train import curves, run_folder
from train.run_folder import RunFolder
from train.metrics import read_splits

HIST_VOXELS = 200_000  # subsampled source voxels per histogram (strided, like the cache's window)
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"]
CSS = """body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1400px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}h3{margin-top:1.4em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}td,th{border:1px solid #ccc;padding:.25em .6em;
text-align:left;vertical-align:top}th{background:#f3f3f3}td.num{text-align:right}img{max-width:100%;
border:1px solid #eee;margin:.3em 0}.note{color:#8a4b00;background:#fff6e5;padding:.4em .7em;border-left:3px
solid #e0a040}pre{background:#f7f7f7;padding:.6em;overflow:auto;font-size:.85em}.err{max-width:48em;
word-break:break-all}.muted{color:#666}"""


# ------------------------------------------------------------------ HTML pieces
def esc(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def table(header: Sequence[str], rows: Sequence[Sequence[object]], wide: Sequence[int] = ()) -> str:
    """An escaped HTML table; numbers right-aligned, columns in `wide` wrap long text."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = []
    for r in rows:
        cells = []
        for i, v in enumerate(r):
            cls = ' class="num"' if isinstance(v, (int, float, np.integer, np.floating)) else (
                ' class="err"' if i in wide else "")
            cells.append(f"<td{cls}>{esc(_fmt(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def image(png: bytes, alt: str) -> str:
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def _fmt(v) -> str:
    """A table cell: floats to 4 significant digits (`n/a` when not finite), None empty."""
    if isinstance(v, (float, np.floating)):
        return cli.fmt_number(v, spec=".4g")
    return "" if v is None else str(v)


def load_manifest(cache: str) -> pd.DataFrame:
    try:
        df = paths.read_manifest_table(cache).to_pandas()
    except FileNotFoundError as exc:
        raise cli.UsageError(f"--cache: no cache manifest at {exc} (run make cache first)") from None
    df["device"] = df["device"].fillna("unknown")
    df["imaging"] = df["imaging"].fillna("")
    df["protocol"] = df["protocol"].fillna("unknown")
    return df


def shape_text(v) -> str:
    return "x".join(str(int(x)) for x in v) if v is not None and len(v) else "-"


def reason_category(status: str, error: str | None) -> str:
    """Manifest reasons start with a category before ':' ("not DICOM: ...")."""
    if status != "failed":
        return status or "unknown"
    return (cli.reason(error) or "no reason")[:80]


def device_counts(df: pd.DataFrame) -> list[list]:
    """Per device and protocol: files, ok, skipped (not selected), failed, other, not in manifest.tsv."""
    rows = []
    for (dev, protocol), g in list(df.groupby(["device", "protocol"], sort=True)) + [(("all", ""), df)]:
        ok, skipped, failed = (int((g.status == s).sum()) for s in ("ok", "skipped", "failed"))
        rows.append([dev, protocol, len(g), ok, skipped, failed, len(g) - ok - skipped - failed,
                     int((g.listed == False).sum())])  # noqa: E712
    return rows


def um(values) -> str:
    """A voxel size in mm as micrometres, D x H x W."""
    return "x".join(f"{1000 * float(v):.0f}" for v in values) if values is not None and len(values) else "-"


def mm(values) -> str:
    return "x".join("-" if v is None or v != v else f"{float(v):.1f}" for v in values) if values is not None else "-"


def scale_rows(df: pd.DataFrame) -> list[list]:
    """Per device and protocol (ok rows): the field (mm), the stored voxel size (um) and what was cut or
    padded: how big one voxel is on each scanner under the chosen resample mode."""
    ok = df[df.status == "ok"]
    t = pd.DataFrame({"device": ok.device, "protocol": ok.protocol, "field": ok["field_mm"].map(mm),
                      "voxel": ok["spacing_mm"].map(um),
                      "crop_pad": ok["crop_pad"].map(lambda v: shape_text(v) if v is not None else "-")})
    return [[*k, int(n)] for k, n in t.groupby(list(t.columns), sort=True).size().items()]


def failure_rows(df: pd.DataFrame) -> list[list]:
    bad = df[df.status != "ok"]
    if bad.empty:
        return []
    bad = bad.assign(category=[reason_category(s, e) for s, e in zip(bad.status, bad.error)])
    rows = [[dev, cat, len(g), g.error.iloc[0], g.relpath.iloc[0]]
            for (dev, cat), g in bad.groupby(["device", "category"], sort=True)]
    return sorted(rows, key=lambda r: (-r[2], r[0], r[1]))


def shape_rows(df: pd.DataFrame) -> list[list]:
    ok = df[df.status == "ok"]
    t = pd.DataFrame({"device": ok.device, "protocol": ok.protocol, "native": ok["native_shape"].map(shape_text),
                      "stored": ok["shape"].map(shape_text),
                      "flipped": ok["flipped"].fillna("no")})
    return [[*k, int(n)] for k, n in t.groupby(list(t.columns), sort=True).size().items()]


def geometry_rows(df: pd.DataFrame) -> list[list]:
    """Per device and protocol: the rows whose witnesses disagree (ingest/scan.py), which witness named
    the protocol, and one warning as an example."""
    warned = df[df.geometry_warning.notna()]
    return [[dev, protocol, len(g), ", ".join(f"{k} {v}" for k, v in g.protocol_by.fillna("none").value_counts().items()),
             g.geometry_warning.iloc[0]] for (dev, protocol), g in warned.groupby(["device", "protocol"], sort=True)]


def window_rows(df: pd.DataFrame) -> list[list]:
    ok = df[df.status == "ok"]
    return [[dev, len(g), g.lo.median(), g.lo.min(), g.lo.max(), g.hi.median(), g.hi.min(), g.hi.max()]
            for dev, g in ok.groupby("device", sort=True)]


# ------------------------------------------------------------------ volumes
@dataclasses.dataclass
class View:
    """What the page shows of one cached volume (the volume itself is not kept)."""
    bscan: np.ndarray          # central frame [H, W], uint8
    enface: np.ndarray         # mean over depth [D, W], float
    hist: np.ndarray           # 256 counts of the stored uint8 values


def sample_groups(df: pd.DataFrame, per_group: int, seed: int) -> dict[tuple[str, str], list[dict]]:
    """Up to `per_group` random ok volumes per (device, protocol): flips are per protocol."""
    ok = df[(df.status == "ok") & df.volume.notna()].sort_values("relpath")
    rng = np.random.default_rng(seed)
    out = {}
    for key, g in ok.groupby(["device", "protocol"], sort=True):
        idx = np.sort(rng.choice(len(g), size=min(per_group, len(g)), replace=False))
        out[key] = schema.frame_to_rows(g.iloc[idx])
    return out


def read_views(cache: str, groups: dict, progress: bool) -> tuple[dict, list[str]]:
    views, problems = {}, []
    todo = [r for rows in groups.values() for r in rows]
    for r in tqdm(todo, desc="report: cached volumes", unit="vol", disable=not progress):
        try:
            vol = store.read_volume(cache, r["volume"])
        except Exception as exc:  # noqa: BLE001 - the page says which volume could not be read
            problems.append(f"{r['volume']}: {type(exc).__name__}: {exc}")
            continue
        views[r["volume"]] = View(vol[vol.shape[0] // 2].copy(), vol.mean(axis=1, dtype=np.float32),
                                  np.bincount(vol.ravel(), minlength=256))
    return views, problems


def _enface_extent(row: dict, enface: np.ndarray):
    """Physical extent (mm) of an en-face image [D, W] when the spacing is known."""
    sp = row.get("spacing_mm")
    d, w = enface.shape
    if sp is not None and len(sp) == 3 and all(math.isfinite(float(s)) and s > 0 for s in (sp[0], sp[2])):
        return [0, w * float(sp[2]), d * float(sp[0]), 0], "equal"
    return None, "auto"


def montage_png(groups: dict, views: dict) -> bytes | None:
    """Rows: (device, protocol). Per volume: the central B-scan (stored window, 0..255) and
    the en-face mean over depth (frame 0 at the top, column 0 at the left)."""
    groups = {k: [r for r in rows if r["volume"] in views] for k, rows in groups.items()}
    groups = {k: v for k, v in groups.items() if v}
    if not groups:
        return None
    plt = plots.pyplot()
    per = max(len(v) for v in groups.values())
    fig, axes = plt.subplots(len(groups), 2 * per, figsize=(2.3 * 2 * per, 2.5 * len(groups)), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i, ((device, imaging), rows) in enumerate(groups.items()):
        for j, r in enumerate(rows):
            v = views[r["volume"]]
            ax_b, ax_e = axes[i, 2 * j], axes[i, 2 * j + 1]
            ax_b.imshow(v.bscan, cmap="gray", vmin=0, vmax=255, aspect="auto", interpolation="antialiased")
            ax_b.set_title(f"{device} {imaging}\n{r.get('participant_id')} {r.get('laterality') or ''} "
                           f"B-scan {v.bscan.shape[0]}x{v.bscan.shape[1]}", fontsize=7)
            lo, hi = np.percentile(v.enface, [1, 99])
            extent, aspect = _enface_extent(r, v.enface)
            ax_e.imshow(v.enface, cmap="gray", vmin=lo, vmax=max(hi, lo + 1e-3), extent=extent, aspect=aspect,
                        interpolation="antialiased")
            flip = list(r.get("flipped_axes") or [])
            ax_e.set_title(f"en-face (frame 0 top)\nflipped axes {flip}", fontsize=7)
    fig.tight_layout()
    return plots.to_png(fig)


def source_histogram(row: dict) -> tuple[np.ndarray, np.ndarray]:
    """Histogram of the decoded source (strided subsample of about HIST_VOXELS voxels)."""
    vol = dicom.decode_volume(fsio.read_bytes(row["source"]), accept_any_sop=True)  # the cache accepted it already
    px = vol.pixels
    sub = subsample(px, HIST_VOXELS).ravel()
    top = 256 if px.dtype == np.uint8 else int(sub.max()) + 1
    return np.histogram(sub, bins=min(256, top), range=(0, top))


def histograms_png(groups: dict, views: dict, per_scanner: int, progress: bool) -> tuple[bytes | None, list[str]]:
    """Per device: source intensities with the manifest's [lo, hi] window, next to the stored uint8."""
    by_device: dict[str, list[dict]] = {}
    for (device, _), rows in groups.items():
        by_device.setdefault(device, []).extend(r for r in rows if r["volume"] in views)
    by_device = {d: rows[:per_scanner] for d, rows in by_device.items() if rows}
    if not by_device:
        return None, []
    problems = []
    plt = plots.pyplot()
    fig, axes = plt.subplots(len(by_device), 2, figsize=(12, 2.6 * len(by_device)), squeeze=False)
    todo = [(d, i, r) for d, rows in by_device.items() for i, r in enumerate(rows)]
    rows_of = {d: k for k, d in enumerate(by_device)}
    for device, i, r in tqdm(todo, desc="report: source histograms", unit="file", disable=not progress):
        ax_s, ax_c = axes[rows_of[device]]
        color = COLORS[i % len(COLORS)]
        label = f"{r.get('participant_id')} {r.get('laterality') or ''} {r.get('imaging') or ''}"
        try:
            counts, edges = source_histogram(r)
            ax_s.stairs(counts / max(counts.sum(), 1), edges, color=color, label=label)
            for x in (r.get("lo"), r.get("hi")):
                if x is not None:
                    ax_s.axvline(x, color=color, ls="--", lw=1)
        except Exception as exc:  # noqa: BLE001 - fail soft: the page names the file and the reason
            problems.append(f"{r.get('source')}: {type(exc).__name__}: {exc}")
        hist = views[r["volume"]].hist
        ax_c.stairs(hist / max(hist.sum(), 1), np.arange(257), color=color, label=label)
    for device, k in rows_of.items():
        ax_s, ax_c = axes[k]
        ax_s.set_title(f"{device}: source (decoded), dashed: window [lo, hi]", fontsize=9)
        ax_c.set_title(f"{device}: cached uint8 after window and resize", fontsize=9)
        for ax in (ax_s, ax_c):
            ax.set_yscale("log")
            ax.set_ylabel("fraction of voxels")
            ax.grid(alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=7)
    fig.tight_layout()
    return plots.to_png(fig), problems


# ------------------------------------------------------------------ the run
def run_summary_rows(train: dict, val: dict, probe: dict | None = None) -> list[list]:
    rows = []
    curves_of = [(train, key, key, title) for key, title in curves.PANELS + [("skipped_updates", "skipped updates")]]
    keys = sorted({k for r in (probe or {}).values() for k in r if k.endswith("_bal_acc")})
    curves_of += [(probe, f"probe/{k}", k, "online probe, val balanced accuracy (first: random init)") for k in keys]
    for records, name, key, title in curves_of:
        vals = [records[s].get(key) for s in sorted(records)]
        finite = [float(v) for v in vals if v is not None and math.isfinite(float(v))]
        if not finite:
            continue
        rows.append([name, title, finite[0], finite[-1], min(finite), max(finite), len(vals) - len(finite)])
    if val:
        vs = sorted(val)
        losses = [val[s].get("loss") for s in vs]
        finite = [float(v) for v in losses if v is not None]
        if finite:
            rows.append(["val/loss", "validation L1 loss", finite[0], finite[-1], min(finite), max(finite),
                         len(losses) - len(finite)])
    return rows


def probe_section(run_dir: Path) -> list[str]:
    parts = []
    for mpath in sorted(RunFolder(run_dir).probe.glob("*/metrics.json")):
        task_dir = mpath.parent
        parts.append(f"<h3>Probe: {esc(task_dir.name)}</h3>")
        try:
            res = json.loads(mpath.read_text())
            rows = []
            for p in res["probes"]:
                t = p["test"]
                rows.append([p["encoder"], p["head"], p.get("lr"), p.get("weight_decay"),
                             p.get("val_balanced_accuracy"), t.get("balanced_accuracy"),
                             cli.fmt_ci(t.get("balanced_accuracy_ci95")), t.get("auroc_macro_ovr"),
                             cli.fmt_ci(t.get("auroc_macro_ovr_ci95")), "YES" if t.get("collapsed") else "no"])
            counts = ", ".join(f"{split} {n}" for split, n in (res.get("counts") or {}).items())
            parts.append(f"<p>classes: {esc(', '.join(map(str, res.get('classes', []))))}; rows per class: "
                         f"{esc(counts)}</p>")
            parts.append(table(["encoder", "head", "lr", "wd", "val bal. acc", "test bal. acc", "95% CI",
                                "test AUROC", "95% CI", "collapsed"], rows))
        except Exception as exc:  # noqa: BLE001 - a broken metrics.json is shown, not fatal
            parts.append(note(f"{mpath}: unreadable: {type(exc).__name__}: {exc}"))
        for name in ("confusion.png", "roc.png"):
            if (task_dir / name).exists():
                parts.append(image((task_dir / name).read_bytes(), f"{task_dir.name} {name}"))
        if (task_dir / "report.md").exists():
            parts.append(f"<details><summary>report.md</summary><pre>{esc((task_dir / 'report.md').read_text())}"
                         "</pre></details>")
    return parts


def run_section(run_dir: Path) -> tuple[list[str], int]:
    """HTML for a run, and how many training rows it logged."""
    parts = [f"<h2>Run: {esc(run_dir.name)}</h2>", f'<p class="muted">{esc(run_dir)}</p>']
    if not run_dir.is_dir():
        return parts + [note(f"{run_dir}: no such run folder")], 0
    splits = read_splits(run_dir)
    train, val = splits.get("train", {}), splits.get("val", {})
    png = curves.curves_png(splits, run_dir.name)
    if png is None:
        parts.append(note(f"{run_dir}/metrics.jsonl: no training rows yet"))
    else:
        parts.append(image(png, "training curves"))
        parts.append(table(["key", "curve", "first", "last", "min", "max", "null (non-finite)"],
                           run_summary_rows(train, val, splits.get("probe", {}))))
    wandb_runs = sorted((run_dir / "wandb").glob("*run-*")) if (run_dir / "wandb").is_dir() else []
    if wandb_runs:
        parts.append(f"<p>W&amp;B runs (same names under train/ and val/; offline ones: "
                     f"<code>wandb sync &lt;dir&gt;</code>): {esc(', '.join(p.name for p in wandb_runs))}</p>")
    if RunFolder(run_dir).config.exists():
        parts.append(f"<details><summary>config.yaml</summary><pre>{esc(RunFolder(run_dir).config.read_text())}"
                     "</pre></details>")
    probes = probe_section(run_dir)
    parts += probes or [note(f"no probe results under {run_dir}/probe/ (make probe)")]
    return parts, len(train)


# ------------------------------------------------------------------ the page
def build(cache: str, run: str | None = None, per_group: int = 4, hist_per_scanner: int = 2, seed: int = 0,
          progress: bool = True) -> tuple[str, dict]:
    """The page as a string, and numbers for the summary."""
    df = load_manifest(cache)
    stats = {"files": len(df), **{s: int((df.status == s).sum()) for s in ("ok", "skipped", "failed")}}
    body = [f"<h1>octfm report</h1><p class=\"muted\">cache {esc(cache)}"
            f"{' &middot; run ' + esc(run) if run else ''} &middot; {esc(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>"]
    body.append("<h2>Cache: files per device and protocol</h2>")
    body.append(table(["device", "protocol", "files", "ok", "skipped (not selected)", "failed", "other (pending)",
                       "not in manifest.tsv"], device_counts(df)))
    body.append("<h3>Failure reasons</h3>")
    fails = failure_rows(df)
    body.append(table(["device", "category", "files", "first reason", "first file"], fails, wide=(3, 4))
                if fails else "<p>No failed rows.</p>")
    body.append("<h3>Native and stored shapes (ok rows)</h3>")
    body.append(table(["device", "protocol", "native frames x rows x cols", "stored D x H x W", "flipped",
                       "files"], shape_rows(df)))
    body.append("<h3>Geometry warnings: where a scan's header, published field and traces disagree</h3>")
    geometry = geometry_rows(df)
    stats["geometry_warnings"] = sum(r[2] for r in geometry)
    body.append(table(["device", "protocol", "files", "protocol told by", "first warning"], geometry, wide=(4,))
                if geometry else "<p>No warnings: every scan's witnesses agree.</p>")
    body.append("<h3>Physical scale (ok rows): the field, one stored voxel, and what resampling cut (-) or padded (+)</h3>")
    body.append(table(["device", "protocol", "field mm (frames x depth x columns)", "voxel um (D x H x W)",
                       "crop/pad voxels", "files"], scale_rows(df)))

    groups = sample_groups(df, per_group, seed)
    views, problems = read_views(cache, groups, progress)
    stats["montage_volumes"] = len(views)
    body.append("<h2>Cached volumes: central B-scan and en-face projection</h2>")
    body.append(f"<p>Up to {per_group} random ok volumes per device and protocol (seed {seed}). B-scans show the "
                "stored 0..255 range as is (a wrong window shows as black or white); en-face images are the mean "
                "over depth with frame 0 at the top and column 0 at the left, in mm where the spacing is known. "
                "All devices and protocols should agree in orientation; left eyes mirror right ones.</p>")
    montage = montage_png(groups, views)
    body.append(image(montage, "montage: central B-scan and en-face projection") if montage
                else note("no ok cached volumes to show"))
    for p in problems:
        body.append(note(f"unreadable cached volume {p}"))

    body.append("<h2>Intensities before and after normalisation</h2>")
    body.append(f"<p>Up to {hist_per_scanner} of the volumes above per scanner: the decoded source (about "
                f"{HIST_VOXELS:,} strided voxels, re-read from the source URI) with the manifest's window "
                "[lo, hi] dashed, and the cached uint8 values. Log scale.</p>")
    body.append(table(["device", "ok files", "lo median", "lo min", "lo max", "hi median", "hi min", "hi max"],
                      window_rows(df)))
    hist, hist_problems = histograms_png(groups, views, hist_per_scanner, progress)
    body.append(image(hist, "intensity histograms") if hist else note("no volumes for histograms"))
    for p in hist_problems:
        body.append(note(f"source not readable, its histogram is missing: {p}"))
    stats["source_unreadable"] = len(hist_problems)

    if run:
        parts, steps = run_section(Path(run))
        body += parts
        stats["run_rows"] = steps
    page = (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>octfm report</title>"
            f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>")
    stats["images"] = page.count("<img ")
    return page, stats


def default_out(cache: str, run: str | None) -> str:
    return str(RunFolder(run).report) if run else fsio.join(cache, run_folder.REPORT)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True, help="cache root (local or gs://)")
    ap.add_argument("--run", default=None, help="run folder runs/<name> (curves, probes)")
    ap.add_argument("--out", default=None, help="HTML file (default <run>/report.html, else <cache>/report.html)")
    ap.add_argument("--per-group", type=int, default=4, help="volumes per device and protocol in the montage")
    ap.add_argument("--hist-per-scanner", type=int, default=2, help="source files re-read per scanner for histograms")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    page, stats = build(a.cache, a.run, a.per_group, a.hist_per_scanner, a.seed, progress=not a.no_progress)
    out = a.out or default_out(a.cache, a.run)
    data = page.encode()
    fsio.atomic_write_bytes(out, data)
    run_txt = f"; run {a.run} ({stats['run_rows']} logged steps)" if a.run else ""
    print(f"report: {out} ({len(data) / 1e6:.2f} MB, {stats['images']} images): {stats['files']} files "
          f"({stats['ok']} ok, {stats['skipped']} skipped, {stats['failed']} failed), {stats['montage_volumes']} volumes shown, "
          f"{stats['source_unreadable']} sources unreadable{run_txt}; {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    cli.run(main)
