"""`make device-check`'s dry run: the script a lent GPU machine runs, on the CPU at tiny sizes
through the same code (sections, subprocesses, result files, verdicts), so it cannot rot between
the sessions that have a GPU."""
import json
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow  # about 6 minutes on 2 cores (two inductor compiles): the heavy lane (CI runs it)
def test_the_dry_run_measures_every_section_and_writes_its_verdicts(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "bench.device_check", "--dry-run", "--budget-s", "100000", "--out",
                        str(out), "--vjepa2", str(tmp_path / "no_checkout")], cwd=REPO, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.loads((out / "device_check.json").read_text())
    errors = {k: v for k, v in res.items() if isinstance(v, dict) and ("error" in v or any(
        isinstance(x, dict) and ("error" in x or "skipped" in x) for x in v.values()))}
    assert res["dry_run"] and not errors, errors
    assert res["environment"]["matmul_bf16_tflops"] > 0
    prod = res["production"]  # the production step first: eager, compiled, cuDNN first, head dim 32 in the predictor (the recipe before its 6 heads)
    assert set(prod) - {"section_s"} == {"eager", "compiled", "cudnn_attention", "pred_heads_12"}
    eager = prod["eager"]
    assert eager["step_s"] > 0 and eager["flops_per_step"] > 0 and eager["mfu"] > 0 and eager["tokens_per_s"] > 0
    assert eager["batch"] == 2 and eager["plan_peak_gib"] > 0 and eager["peak_gib"] is None  # no GPU memory here
    # a compiled step's FLOPs are the eager one's (a dispatch mode would retrace it); the head-dim change has its own
    assert prod["compiled"]["compile"] and prod["compiled"]["flops_per_step"] == eager["flops_per_step"]
    assert prod["pred_heads_12"]["flops_per_step"] > 0
    # a CPU has no datasheet peak: MFU is taken against the bf16 matmul measured at one size, which the step's
    # own mix can outrun (on an AMD EPYC without bf16 units it did: 1.05), so no upper bound holds here
    assert res["environment"]["datasheet_bf16_tflops"] is None and "mfu_of_datasheet" not in eager
    assert eager["profile_op_calls_per_step"] > 1000 and eager["profile_device_ms_per_step"] is None
    assert "gpu_busy_frac" not in eager and len(eager["profile_top"]) == 12
    assert sum(ms for _, ms, _ in eager["profile_top"]) <= eager["profile_host_ms_per_step"]
    ck = res["check"]  # the GPU-size learning check's step, on a cache of its shape
    assert ck["eager"]["tokens"] == 288 and ck["compiled"]["compile"]  # its 8 x 6 x 6 grid
    # the recipe's samples (1,850 x 256) at the step's batch (2 in the dry run)
    assert ck["eager"]["steps_for_the_check"] == 1850 * 256 // ck["eager"]["batch"] and ck["eager"]["batch"] == 2
    assert ck["eager"]["pretrain_s"] == pytest.approx(ck["eager"]["steps_for_the_check"] * ck["eager"]["step_s"])
    assert "no vjepa2 checkout" in res["reference"]["skipped"]
    run = res["run"]  # a real make pretrain of the production config, volumes from disk
    assert 0 <= run["data_wait_frac"] <= 1 and run["workers"] >= 1 and run["run_samples_per_s"] > 0 and run["steps"] == 8
    ct = res["cuda_tests"]
    assert ct["tests"] == ct["skipped"] >= 6 and not ct["failed"]  # no GPU here: every CUDA test skips
    md = (out / "device_check.md").read_text()
    for line in ("MFU of the production (ViT-B) step in bf16 at batch 2", "octfm / vjepa2: not measured",
                 "data wait in a real make pretrain (8 steps", "CUDA tests: 0 passed", "the check's step at batch 2: eager",
                 "make plan against the measured peak: not measured", "| pred_heads_12 |",
                 "bf16): where a step's time goes (torch.profiler)", "eager: host time in ops and runtime calls"):
        assert line in md, md
    assert not (out / "work").exists()


def test_the_budget_skips_what_it_cannot_fit_and_says_so(tmp_path):
    """Each variant after the first starts only with the budget it needs left; a skipped or failed
    one is recorded with its reason and the next still runs (a call cut short keeps the rest)."""
    from bench import device_budget, device_report

    left = iter([100, 10, 100])  # read once per variant that needs budget (b, c, d)
    ctx = {"left": lambda: next(left), "out": tmp_path, "results": {}}
    ran = []

    def one(name, spec, done):
        ran.append(name)
        if name == "d":
            raise RuntimeError("CUDA out of memory")
        return {"step_s": 1.0, "seen": sorted(done), "params_m": 1.0, "batch": 2, "tokens": 64, "tokens_per_s": 128.0,
                "first_step_s": 1.0}

    got = device_budget.variants(ctx, "production", {"a": (0,), "b": (50,), "c": (50,), "d": (50,)}, one)
    assert ran == ["a", "b", "d"] and got["b"]["seen"] == ["a"]
    assert "50 s of budget needed, 10 s left" in got["c"]["skipped"] and "out of memory" in got["d"]["error"]
    assert json.loads((tmp_path / "device_check.json").read_text())["production"]["d"]["error"]
    lines = device_report.step_table(got, "t")
    assert any(ln.startswith("| c | skipped: 50 s") for ln in lines) and any(ln.startswith("| d | failed:") for ln in lines)


def test_without_a_gpu_the_real_check_refuses_and_says_why(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.device_check", "--out", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA device here" in r.stderr
    r = subprocess.run(["make", "-s", "device-check"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "set OUT=" in r.stderr


def _event(key, device, self_cpu=0.0, self_device=0.0, count=1, annotation=False):
    """A stand-in for one row of torch.profiler's key_averages (the fields profile_summary reads)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    return SimpleNamespace(key=key, device_type=getattr(DeviceType, device), self_cpu_time_total=self_cpu,
                           self_device_time_total=self_device, count=count, is_user_annotation=annotation)


def test_the_profile_counts_each_kernel_once_and_leaves_the_host_waits_out():
    """A CPU op's self device time repeats its kernels' (torch sums device rows only): two steps of
    an op launching a 10 us kernel are 10 us of device time per step, not 20; a GPU annotation and
    the host's synchronize are neither work nor device time."""
    from bench.device_steps import profile_summary

    events = [_event("aten::mm", "CPU", self_cpu=8.0, self_device=20.0, count=2),
              _event("cudaLaunchKernel", "CPU", self_cpu=6.0, count=2),
              _event("cudaDeviceSynchronize", "CPU", self_cpu=500.0, count=1),
              _event("Optimizer.step#AdamW.step", "CPU", self_cpu=4.0, count=2, annotation=True),
              _event("sm90_gemm_bf16", "CUDA", self_device=20.0, count=2),
              _event("Optimizer.step#AdamW.step", "CUDA", self_device=30.0, count=2, annotation=True)]
    got = profile_summary(events, steps=2, cuda=True)
    assert got["profile_device_ms_per_step"] == pytest.approx(0.010) and got["profile_kernels_per_step"] == 1
    assert got["profile_host_ms_per_step"] == pytest.approx(0.007)    # mm and the launches, not the wait
    assert got["profile_op_calls_per_step"] == 1 and [r[0] for r in got["profile_top"]] == ["sm90_gemm_bf16"]
    assert "profile_error" in profile_summary(events[:4], steps=2, cuda=True)   # no kernel rows: said, not 0% busy
    cpu = profile_summary(events[:2], steps=2, cuda=False)
    assert cpu["profile_device_ms_per_step"] is None and cpu["profile_top"][0][0] == "aten::mm"


def test_a_step_process_that_dies_after_its_timing_keeps_the_timing():
    """The step's timing is printed before its profile: a crash in the profiler (CUPTI) keeps the
    measured step, with the error beside it; a process that printed nothing raises with its stderr."""
    from bench.device_steps import run_json

    code = "import json, sys; print(json.dumps({'step_s': 0.1}), flush=True); sys.exit('profiler died')"
    assert run_json(code, timeout=60) == {"step_s": 0.1, "late_error": "profiler died\n"}
    merged = run_json("import json; print(json.dumps({'a': 1})); print('noise'); print(json.dumps({'b': 2}))", 60)
    assert merged == {"a": 1, "b": 2}
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        run_json("raise RuntimeError('CUDA out of memory')", timeout=60)


def _lc_args(tmp_path, **make):
    """bench.device_run's learning-check arguments as `make learning-check-device` passes its variables."""
    from bench import device_run

    keys = {"out": str(tmp_path / "out"), "work": str(tmp_path / "work"), "cue": "", "seed": "", "finetune": "",
            "ft_seeds": "", "smoke": "", "timeout": "", **make}
    argv = ["learning-check", *(x for k, v in keys.items() for x in (f"--{k.replace('_', '-')}", v))]
    return device_run.parser().parse_args(argv)


def test_learning_check_device_builds_the_check_command_from_make_variables(tmp_path):
    """FINETUNE, FT_SEEDS, SMOKE, SEED, CUE, TIMEOUT and ARGS as the Makefile's shell line read them; the GPU
    size asks the label-efficiency question (the 10% reference) as it did before the CPU default dropped it."""
    from bench.device_run import SMOKE_ARGS, check_command

    cmd = check_command(_lc_args(tmp_path), ["max_steps=3"])
    assert cmd[1:10] == ["-m", "check.learning_check", "--size", "gpu", "--cue", "lesions", "--label-efficiency",
                         "--finetune", "--finetune-fraction"] and cmd[-1] == "max_steps=3"
    assert cmd[cmd.index("--finetune-seeds") + 1] == "3" and cmd[cmd.index("--work") + 1] == f"{tmp_path}/work/data"
    smoke = check_command(_lc_args(tmp_path, smoke="1", seed="157", cue="layers", timeout="540"), [])
    assert smoke[:2] == ["timeout", "540"] and smoke[smoke.index("--finetune-seeds") + 1] == "1"
    assert smoke[smoke.index("--seed") + 1] == "157" and "layers" in smoke and smoke[-len(SMOKE_ARGS):] == list(SMOKE_ARGS)
    two = check_command(_lc_args(tmp_path, smoke="1", ft_seeds="2"), [])
    assert two[two.index("--finetune-seeds") + 1] == "2"
    off = check_command(_lc_args(tmp_path, finetune="0", ft_seeds="5"), [])
    assert "--finetune" not in off and "--finetune-seeds" not in off and "--seed" not in off
    # CUE=scanners asks its one question: no reference nor fine-tuning per held-out scanner (the check refuses them)
    scanners = check_command(_lc_args(tmp_path, cue="scanners"), [])
    assert "--label-efficiency" not in scanners and "--finetune" not in scanners
    from bench.device_run import HELD_OUT_CUES
    from check import learning_check

    assert set(HELD_OUT_CUES) == {c for c, cue in learning_check.CUES.items() if cue.protocol != "splits"}
    for c in (cmd, smoke, two, off, scanners):                   # each a command line the check takes
        learning_check.command_line(c[c.index("--size"):])


def test_learning_check_device_brings_back_the_log_and_results_of_a_run_cut_short(tmp_path, monkeypatch, capfd):
    """The check's exit status is the target's, its output both on the terminal and in OUT's log, and the
    result files and the newest pretraining's metrics and curves land in OUT although the run failed."""
    from bench import device_run

    runs = tmp_path / "work" / "runs"
    script = (f"import os, pathlib, sys, time; r = pathlib.Path({str(runs)!r}); (r / 'lesions').mkdir(parents=True);"
              "(r / 'lesions' / 'result_interim.json').write_text('{}');"
              "[((r / n).mkdir(), (r / n / 'metrics.jsonl').write_text(n), time.sleep(0.05)) for n in ('pretrain_a', 'pretrain_b')];"
              "print('stage done', flush=True); sys.exit(124)")
    monkeypatch.setattr(device_run, "check_command", lambda a, args: [sys.executable, "-c", script])
    monkeypatch.setattr(device_run, "DEVICE", tmp_path / "no_device")  # no wheels: nothing to install
    assert device_run.learning_check(_lc_args(tmp_path), []) == 124
    out = tmp_path / "out"
    assert "stage done" in capfd.readouterr().out and "stage done" in (out / "learning_check.log").read_text()
    assert (out / "result_interim.json").exists() and (out / "pretrain_metrics.jsonl").read_text() == "pretrain_b"
    assert not (out / "pretrain_curves.png").exists()


def test_wheelhouse_copies_vjepa2s_sources_and_commit(tmp_path):
    """make wheelhouse VJEPA2_SRC=...: src/ and app/ at the checkout's HEAD (not its other folders, not its
    uncommitted edits), and the short commit."""
    from bench.device_run import copy_vjepa2

    repo = tmp_path / "vjepa2"
    for rel in ("src/models/vit.py", "app/main.py", "evals/x.py"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(rel)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        subprocess.run([*git, *args], check=True)
    (repo / "src/models/vit.py").write_text("edited")
    dest = copy_vjepa2(repo, tmp_path / "device" / "vjepa2")
    assert (dest / "src/models/vit.py").read_text() == "src/models/vit.py" and (dest / "app/main.py").exists()
    assert not (dest / "evals").exists()
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    assert (dest / "COMMIT").read_text() == head
