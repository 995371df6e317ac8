"""`make device-check`'s dry run: the script a lent GPU machine runs, on the CPU at tiny sizes
through the same code (sections, subprocesses, result files, verdicts), so it cannot rot between
the sessions that have a GPU."""
import json
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow  # 35 s on 2 cores: the heavy lane (CI runs it), so make test stays inside its budget
def test_the_dry_run_measures_every_section_and_writes_its_verdicts(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "bench.device_check", "--dry-run", "--budget-s", "0", "--out", str(out),
                        "--vjepa2", str(tmp_path / "no_checkout")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.loads((out / "device_check.json").read_text())
    errors = {k: v["error"] for k, v in res.items() if isinstance(v, dict) and "error" in v}
    assert res["dry_run"] and not errors, errors
    assert res["environment"]["matmul_bf16_tflops"] > 0
    ct = res["cuda_tests"]
    assert ct["tests"] == ct["skipped"] >= 6 and not ct["failed"]  # no GPU here: every CUDA test skips
    t = res["train"]["vit_b"]  # the dry run runs one size (a GPU runs smoke, vit_s and vit_b through the same code)
    assert t["step_s"] > 0 and t["flops_per_step"] > 0 and 0 < t["mfu"] < 1 and t["tokens_per_s"] > 0
    assert t["batch"] == 2  # the plan's largest batch, capped for the dry run
    assert "vit_b_compiled" not in res["train"]  # no budget left for the optional compiled step
    ck = res["check"]  # the GPU-size learning check's step, on a cache of its shape
    assert "compiled" not in ck and ck["eager"]["tokens"] == 288  # its 8 x 6 x 6 grid; no budget for compiling
    assert ck["eager"]["pretrain_s"] == pytest.approx(3700 * ck["eager"]["step_s"])  # its max_steps
    prof = ck["eager"]  # profiled after its timing: where the step's time goes (on the CPU, host time only)
    assert prof["profile_op_calls_per_step"] > 1000 and prof["profile_device_ms_per_step"] is None
    assert "gpu_busy_frac" not in prof and len(prof["profile_top"]) == 12
    assert sum(ms for _, ms, _ in prof["profile_top"]) <= prof["profile_host_ms_per_step"]
    assert "no vjepa2 checkout" in res["reference"]["skipped"]
    ld = res["loader"]
    assert 0 <= ld["data_wait_frac"] <= 1 and ld["workers"] >= 1 and ld["run_samples_per_s"] > 0
    md = (out / "device_check.md").read_text()
    for line in ("MFU of the production (ViT-B) step", "octfm / vjepa2: not measured", "data wait with the default loader",
                 "CUDA tests: 0 passed", "GPU-size learning check's pretraining at the measured step: eager",
                 "bf16): where a step's time goes (torch.profiler)", "eager: host op time"):
        assert line in md, md
    assert not (out / "work").exists()


def test_without_a_gpu_the_real_check_refuses_and_says_why(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.device_check", "--out", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA device here" in r.stderr
    r = subprocess.run(["make", "-s", "device-check"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "set OUT=" in r.stderr
