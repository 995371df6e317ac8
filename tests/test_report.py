"""`make report`: the page renders in headless Chromium with every image loaded, untrusted
manifest text stays text, unreadable sources are reported on the page, and the synthetic
data keeps the up-down cue the en-face montage relies on."""
import base64
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import REPO, run_cli, run_here
from ingest import phantom
from manifests import schema
from octfm import fsio

# Without the background-networking flags Chromium waits on the closed network.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--virtual-time-budget=15000"]
# Appended to a copy of the page: after `load` (every image loaded or failed), one 1 or 0 per <img>.
PROBE = ("<script>window.addEventListener('load', () => { const p = document.createElement('pre');"
         "p.textContent = 'IMAGES:' + Array.from(document.images, i => (i.complete && i.naturalWidth > 0) ? '1' : '0')"
         ".join('') + ':END'; document.body.appendChild(p); });</script>")
EVIL = '<img src=x onerror="alert(1)">: injected reason'


def image_status(chromium: str, page: Path, tmp_path: Path) -> str:
    """'1' per image Chromium loaded, '0' per broken one, in page order."""
    html = page.read_text()
    head, sep, tail = html.rpartition("</body>")
    assert sep, "no </body> in the page"
    probe_page = page.with_name(f"probe-{page.name}")
    probe_page.write_text(head + PROBE + sep + tail)
    profile = tmp_path / f"chromium-profile-{page.stem}"
    r = subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", probe_page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    m = re.search(r"IMAGES:([01]*):END", r.stdout)
    assert m, f"no image status in Chromium's DOM (status {r.returncode}): {r.stderr[-2000:]}"
    return m.group(1)


@pytest.fixture(scope="module")
def qc_cache(tiny_cache, tmp_path_factory) -> Path:
    """tiny_cache's volumes under a manifest with hostile text in a failure reason and one
    device whose sources are gone."""
    root = tmp_path_factory.mktemp("qc") / "cache"
    root.mkdir()
    (root / "volumes").symlink_to(tiny_cache / "volumes", target_is_directory=True)
    df = schema.read_manifest(str(tiny_cache / "manifest.parquet"))
    df.loc[df.index[0], ["status", "error", "volume"]] = ["failed", EVIL, None]
    gone = df.device == sorted(df.device.unique())[-1]
    df.loc[gone, "source"] = [str(root / "gone" / f"{i}.dcm") for i in range(int(gone.sum()))]
    (root / "manifest.parquet").mkdir()
    fsio.write_parquet_atomic(schema.to_table(schema.frame_to_rows(df), schema.CACHE_SCHEMA),
                              str(root / "manifest.parquet" / "part-0000-of-0001.parquet"))
    return root


def data_uri_pngs(html: str) -> list[Image.Image]:
    srcs = re.findall(r'<img [^>]*src="([^"]*)"', html)
    assert all(s.startswith("data:image/png;base64,") for s in srcs), [s[:40] for s in srcs]
    return [Image.open(io.BytesIO(base64.b64decode(s.split(",", 1)[1]))) for s in srcs]


@pytest.mark.slow  # headless chromium, about 14 s: the heavy lane; make test keeps the report's own checks
def test_report_renders_in_chromium_and_every_image_loads(chromium, qc_cache, probed_wandb_run, tmp_path):
    wandb_run = probed_wandb_run
    out = tmp_path / "report.html"
    r = run_cli("report", "--cache", str(qc_cache), "--run", str(wandb_run), "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    unreadable = int(re.search(r"(\d+) sources unreadable", summary).group(1))
    assert summary.startswith(f"report: {out}") and unreadable >= 1, summary
    html = out.read_text()
    # self-contained: no scripts, stylesheets or remote references; every image a PNG data URI
    assert "<script" not in html and "<link" not in html and "http://" not in html and "https://" not in html
    pngs = data_uri_pngs(html)
    tasks = sorted(p.parent.name for p in (wandb_run / "probe").glob("*/metrics.json"))
    assert tasks == ["diabetic", "study_group"]
    assert len(pngs) == 3 + 2 * len(tasks)  # montage, histograms, curves; confusion + ROC per task
    assert all(im.format == "PNG" and min(im.size) >= 200 for im in pngs)
    # hostile manifest text is shown as text, never as markup
    assert EVIL not in html and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;: injected reason" in html
    assert html.count("source not readable") == unreadable and str(qc_cache / "gone") in html
    df = schema.read_manifest(str(qc_cache / "manifest.parquet"))
    for device in df.device.unique():
        assert f"<td>{device}</td>" in html
    for text in ("val/loss", "rankme", "ema_momentum", "samples_per_s", "data_wait_frac", "Probe: study_group",
                 "Probe: diabetic", "W&amp;B runs"):
        assert text in html, text
    status = image_status(chromium, out, tmp_path)
    assert status == "1" * len(pngs), status


@pytest.mark.slow  # chromium: the heavy lane
def test_image_check_detects_broken_images(chromium, tmp_path):
    buf = io.BytesIO()
    Image.new("L", (8, 8), 128).save(buf, format="PNG")
    good = base64.b64encode(buf.getvalue()).decode()
    page = tmp_path / "broken.html"
    page.write_text(f'<!DOCTYPE html><html><body><img src="data:image/png;base64,{good}">'
                    f'<img src="data:image/png;base64,{good[:len(good) // 2]}"><img src="missing.png"></body></html>')
    assert image_status(chromium, page, tmp_path) == "100"


def test_a_light_lane_test_that_asks_for_chromium_fails(tmp_path):
    """`make test` runs on machines without chromium: a test outside the heavy lane that asks for it
    fails with the fix, wherever chromium is installed (a skip would hide it until a fresh machine)."""
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('repo_conftest', {str(REPO / 'tests' / 'conftest.py')!r})\n"
        "repo = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(repo)\nchromium = repo.chromium\n")
    (tmp_path / "test_light.py").write_text("def test_light(chromium):\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "--rootdir", str(tmp_path), str(tmp_path / "test_light.py")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "CHROMIUM": "/bin/true"})
    assert r.returncode == 1 and "1 error" in r.stdout, r.stdout[-2000:]
    assert "a light-lane test asked for chromium" in r.stdout, r.stdout[-2000:]


def test_cache_only_report_goes_next_to_the_manifest_and_a_missing_cache_is_a_usage_error(qc_cache, tmp_path):
    r = run_cli("report", "--cache", str(qc_cache), "--no-progress", "--per-group", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    html = (qc_cache / "report.html").read_text()
    assert "Run:" not in html and len(data_uri_pngs(html)) == 2
    r = run_here("report.page", "--cache", str(tmp_path / "nowhere"), "--no-progress")
    assert r.returncode == 2 and str(tmp_path / "nowhere") in r.stderr


@pytest.mark.parametrize("laterality", ["R", "L"])
def test_synthetic_volumes_carry_an_up_down_cue(laterality):
    """The vessel shadow lies in the frames before the middle, so the en-face montage shows a
    frame-reversed cube (one written bottom to top, not flipped by its traces) upside down."""
    vol = phantom.make_volume((32, 64, 64), np.random.default_rng(0), laterality)
    enface = vol.mean(axis=1)                    # [frames, cols]
    darkest = enface.argmin(axis=0)              # per column: the frame under the vessel
    assert (darkest < 16).mean() > 0.75, darkest
    assert (vol[::-1].mean(axis=1).argmin(axis=0) < 16).mean() < 0.25


def test_the_curves_figure_is_titled_with_the_run_not_a_panel(monkeypatch):
    """curves.png's title names the run (a loop over the panels once overwrote it with the last
    panel's title, "data wait fraction", seen on the H200 run's curves)."""
    from train import curves

    from octfm.plots import pyplot

    seen = {}

    def title(fig, dpi):
        seen["title"] = fig.get_suptitle()
        pyplot().close(fig)

    monkeypatch.setattr(curves, "to_png", title)
    rec = {"loss": 1.0, "lr": 1e-4, "grad_norm": 1.0, "ema_momentum": 0.99, "rankme": 3.0, "target_std": 0.5,
           "samples_per_s": 10.0, "data_wait_frac": 0.1}
    curves.curves_png({"train": {1: rec, 2: rec}}, "pretrain_9582d1f4")
    assert seen["title"] == "pretrain_9582d1f4"
