"""The device targets' steps, so the Makefile stays a list of commands (`make help` names them).

- `wheelhouse`: the wheels a GPU machine lent without network lacks (bench/device_wheels.txt), for its
  Python, and a copy of facebookresearch/vjepa2's src/ and app/ for the reference step, in .device/.
- `device-check`: on that machine (its own python3, no venv), the wheels into a temporary site folder,
  then `python -m bench.device_check --out OUT ...` in this process's place.
- `learning-check`: likewise, then the learning check at GPU size from nothing: its cohort, cache and
  runs under --work, off OUT; its log, result files and the pretraining's metrics and curves copied
  into OUT, also when --timeout cuts it short (result_interim.* then keeps the headline rows).

Standard library only: it runs before the wheels are installed. Arguments after `--` go to the
program run (make's ARGS, split as the shell splits them).
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Sequence

DEVICE = Path(".device")
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# SMOKE=1: every stage on the GPU at a small size (128 participants, 150 steps, short fine-tuning; about
# a minute of work on the H200 beside the first step's cost, docs/accelerators.md), one fine-tuning seed
SMOKE_ARGS = ("--participants", "128", "--bootstrap", "100", "--finetune-arg", "epochs=3", "--finetune-arg",
              "frozen_epochs=1", "max_steps=150", "log_every=50", "eval_every=75", "ckpt_every=150")
# the cues whose probes hold each scanner out in turn (check/cohort.py CUES, protocol "scanners"), named here: this
# module runs on the GPU machine's own python before the project's dependencies are installed
HELD_OUT_CUES = ("scanners",)
PRETRAIN_COPIES = ("metrics.jsonl", "curves.png")  # from the newest pretraining run, as OUT/pretrain_<name>


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    a = parser().parse_args(own)
    if a.command == "wheelhouse":
        return wheelhouse(a.python_version, a.vjepa2)
    if not a.out:
        return usage(f"make {a.target}: set OUT=<folder for {a.wants}>")
    if a.command == "device-check":
        return device_check(a.out, rest)
    return learning_check(a, rest)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.device_run")
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheelhouse", help="make wheelhouse")
    w.add_argument("--python-version", default="3.12", help="the GPU machine's Python (WHEEL_PY)")
    w.add_argument("--vjepa2", default="", help="a facebookresearch/vjepa2 checkout (VJEPA2_SRC); empty: none")
    d = sub.add_parser("device-check", help="make device-check")
    d.set_defaults(target="device-check", wants="device_check.json and .md")
    c = sub.add_parser("learning-check", help="make learning-check-device")
    c.set_defaults(target="learning-check-device", wants="the result files")
    c.add_argument("--work", default="/tmp/octfm-learning-check", help="cohort, cache and runs (LC_WORK)")
    c.add_argument("--cue", default="", help="CUE (empty: lesions)")
    c.add_argument("--seed", default="", help="SEED (empty: the check's default)")
    c.add_argument("--finetune", default="", help="FINETUNE: 0 leaves the fine-tuning rows out")
    c.add_argument("--ft-seeds", default="", help="FT_SEEDS (empty: 3, or 1 with SMOKE)")
    c.add_argument("--smoke", default="", help="SMOKE: any value runs every stage small")
    c.add_argument("--timeout", default="", help="TIMEOUT: seconds before the check is stopped (empty: none)")
    for p in (d, c):
        p.add_argument("--out", default="", help="OUT: the folder the results come back in")
    return ap


def usage(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def wheelhouse(python_version: str, vjepa2: str) -> int:
    """pip download of bench/device_wheels.txt for another machine's Python (no venv needed), and
    vjepa2's src/ and app/ at its HEAD with the commit in COMMIT."""
    wheels = DEVICE / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    platforms = [arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(wheels),
                    "-r", "bench/device_wheels.txt"], check=True)
    made = [wheels]
    if vjepa2:
        made.append(copy_vjepa2(Path(vjepa2), DEVICE / "vjepa2"))
    for folder in made:
        print(f"wheelhouse: {folder_mb(folder):.0f} MB {folder}")
    return 0


def copy_vjepa2(checkout: Path, dest: Path) -> Path:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(checkout), "archive", "HEAD", "src", "app"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], check=True,
                            capture_output=True, text=True).stdout
    (dest / "COMMIT").write_text(commit)
    return dest


def folder_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def site_env() -> dict:
    """The environment the device programs run in: the carried wheels (if any) installed into a fresh
    temporary site folder ahead of this checkout on PYTHONPATH, output unbuffered."""
    site = tempfile.mkdtemp(prefix="octfm-site-")
    wheels = sorted(str(w) for w in (DEVICE / "wheels").glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", site, *wheels], check=True)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.getcwd()]), "PYTHONUNBUFFERED": "1"}


def device_check(out: str, args: Sequence[str]) -> int:
    """bench.device_check in this process's place: its signals and exit status are the target's."""
    env = site_env()
    os.execve(sys.executable, [sys.executable, "-m", "bench.device_check", "--out", out, *args], env)
    return 1  # not reached


def check_command(a: argparse.Namespace, args: Sequence[str]) -> list[str]:
    """The learning check's command line at GPU size: the label-efficiency question (the 10% reference),
    fine-tuning at 10% of labels over FT_SEEDS training seeds unless FINETUNE=0, SMOKE's small sizes, then ARGS.
    CUE=scanners asks whether pretraining learns alone: it trains no reference nor fine-tuning per held-out
    scanner (check/config.py refuses them)."""
    cue = a.cue or "lesions"
    per_fold = cue not in HELD_OUT_CUES
    cmd = [sys.executable, "-m", "check.learning_check", "--size", "gpu", "--cue", cue,
           *(["--label-efficiency"] if per_fold else [])]
    if a.seed:
        cmd += ["--seed", a.seed]
    if a.finetune != "0" and per_fold:
        cmd += ["--finetune", "--finetune-fraction", "0.1", "--finetune-seeds", a.ft_seeds or ("1" if a.smoke else "3")]
    cmd += ["--work", f"{a.work}/data", "--out", f"{a.work}/runs", *(SMOKE_ARGS if a.smoke else ()), *args]
    return ["timeout", a.timeout, *cmd] if a.timeout else cmd


def learning_check(a: argparse.Namespace, args: Sequence[str]) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rc = tee(check_command(a, args), site_env(), out / "learning_check.log")
    copy_results(Path(a.work) / "runs", a.cue or "lesions", out)
    return rc


def tee(cmd: Sequence[str], env: dict, log: Path) -> int:
    """Run `cmd` with stdout and stderr together, each line to this terminal and to `log`; its exit status."""
    with open(log, "wb") as f, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as p:
        for line in p.stdout:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()
            f.write(line)
    return p.returncode if p.returncode >= 0 else 128 - p.returncode  # a signal's death as the shell reports it


def copy_results(runs: Path, cue: str, out: Path) -> None:
    """What a cut-short call still brings back: the cue's result files and the newest pretraining's
    metrics and curves (each only where it exists)."""
    for f in sorted((runs / cue).glob("result*")):
        if f.is_file():
            shutil.copy(f, out / f.name)
    pretrains = sorted((d for d in runs.glob("pretrain_*") if d.is_dir()), key=lambda d: d.stat().st_mtime)
    for name in PRETRAIN_COPIES if pretrains else ():
        if (pretrains[-1] / name).is_file():
            shutil.copy(pretrains[-1] / name, out / f"pretrain_{name}")


if __name__ == "__main__":
    sys.exit(main())
