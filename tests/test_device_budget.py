"""make device-check's budget: one lent GPU call of about ten minutes, the most telling
numbers first. Each item has a predicted cost (CPU measurements scaled to the GPU) and a cap; it
starts only when its prediction fits in what is left and is stopped at its cap. No GPU needed."""
import json
import signal
import subprocess
import sys
import time

import pytest

from bench import device_budget, device_check as dc, device_steps
from bench import device_report, reference_bench
from conftest import REPO
from octfm import cli


def test_the_items_come_in_the_order_of_what_each_tells_per_second():
    assert [it.key for it in device_budget.plan_items()] == [
        "environment", "production/eager", "production/pred_heads_12", "production/cudnn_attention", "reference",
        "stem_conv", "production/compiled", "check/eager", "check/compiled", "run", "cuda_tests"]
    assert all(it.cap_s > it.predicted_s > 0 for it in device_budget.plan_items())


def test_what_470_seconds_buy():
    """The call's budget (docs/accelerators.md: `timeout 560 make device-check ARGS="--budget-s 470"`)
    at the predicted costs: the production step eager, with head dim 32 and with cuDNN attention,
    and vjepa2 beside octfm, all fit; so do the stem's convolution, the compiled production step and
    the check's eager step. The check's compiled step, the real run and the CUDA tests do not (a
    call whose items take less than predicted reaches them: the rule reads the clock)."""
    items = device_budget.plan_items()
    print("\n".join(f"{it.key:28s} predicted {it.predicted_s:6.1f} s, cap {it.cap_s:4.0f} s" for it in items))
    got = dict(device_budget.budget_plan(items, 470))
    print(got)
    for key in ("environment", "production/eager", "production/pred_heads_12", "production/cudnn_attention",
                "reference"):
        assert got[key] is None, (key, got[key])
    runs = [k for k, why in got.items() if why is None]
    assert runs == ["environment", "production/eager", "production/pred_heads_12", "production/cudnn_attention",
                    "reference", "stem_conv", "production/compiled", "check/eager"]
    assert all("s of budget needed" in got[k] for k in ("check/compiled", "run", "cuda_tests"))
    assert sum(it.predicted_s for it in items if got[it.key] is None) <= 470


def test_the_predictions_scale_the_cpu_measurements():
    """The compile is the CPU's front end (dynamo + AOTAutograd) times 1 + the back end's
    multiplier; a step's seconds are its FLOPs over the GPU's assumed rate; only the first item
    to read the production cache pays for it."""
    c = device_budget.predicted_costs()
    m, g = device_budget.CPU_MEASURED, device_budget.GPU_ASSUMED
    compile_s = c["production/compiled"] - c["production/pred_heads_12"]
    assert compile_s == pytest.approx((m["first_use_s"] + m["front_end_blocks_s"]) * (1 + g["backend_x"]))
    assert c["production/eager"] - c["production/pred_heads_12"] == pytest.approx(m["cache_s"] / g["parallel_x"])
    faster = device_budget.predicted_costs(gpu={**g, "tflops": 2 * g["tflops"]})
    saved = c["production/pred_heads_12"] - faster["production/pred_heads_12"]
    assert saved == pytest.approx(device_budget.STEPS * m["step_tflop"] / g["tflops"] / 2)
    # the whole step's compile, were it chosen, would not leave the check room
    whole = (m["first_use_s"] + m["front_end_whole_s"]) * (1 + g["backend_x"])
    assert whole > 4 * compile_s


def test_an_item_starts_only_when_its_prediction_fits_and_says_so():
    now = [0.0]
    budget = device_budget.Budget(100, clock=lambda: now[0])
    now[0] = 70.0
    assert budget.left() == 30
    assert device_budget.refusal(45, budget.left()) == "45 s of budget needed, 30 s left"
    assert device_budget.refusal(30, budget.left()) is None
    item = device_budget.Item("production", "eager", predicted_s=20, cap_s=60)
    assert device_budget.limit(item, 30) == (30, "the budget's end")   # less left than its cap
    assert device_budget.limit(item, 300) == (60, "its cap")
    assert device_budget.budget_plan([item, device_budget.Item("run", None, 15, 40)], 30) == [("production/eager", None),
                                                                  ("run", "15 s of budget needed, 10 s left")]


@pytest.mark.slow  # processes stopped at their caps, about 3 s: the heavy lane
def test_an_item_past_its_cap_is_stopped_and_the_next_still_runs(tmp_path):
    """In-process work is stopped by an alarm at the cap; a subprocess by its timeout (what it
    printed before is kept); the result says where it stopped, beside its prediction."""
    ctx = {"left": lambda: 1000.0, "out": tmp_path, "results": {}}
    step = {"step_s": 1.0, "params_m": 1.0, "batch": 2, "tokens": 64, "tokens_per_s": 128.0, "first_step_s": 1.0}

    def one(name, spec, done):
        if name == "slow":
            time.sleep(5)
        if name == "slow_process":  # its timing printed, then stuck (in its profile, say)
            code = f"import json, time; print(json.dumps({ {**step, 'step_s': 0.1} }), flush=True); time.sleep(30)"
            return device_steps.run_json(code, timeout=device_budget.remaining(ctx))
        return step

    t = time.monotonic()
    got = device_budget.variants(ctx, "production", {"slow": (device_budget.Item("production", "slow", 0.5, 1),),
                                          "slow_process": (device_budget.Item("production", "slow_process", 0.5, 4),),
                                          "next": (device_budget.Item("production", "next", 0.5, 5),)}, one)
    assert time.monotonic() - t < 15
    assert got["slow"]["stopped"] == "stopped at its cap (1 s)" and got["slow"]["predicted_s"] == 0.5
    assert got["slow_process"]["step_s"] == 0.1 and "stopped after 2 s" in got["slow_process"]["stopped"]
    assert got["next"]["step_s"] == 1.0 and got["next"]["took_s"] < 1
    lines = device_report.step_table(got, "t")
    assert any(ln.startswith("| slow | stopped: stopped at its cap (1 s)") for ln in lines)
    assert json.loads((tmp_path / "device_check.json").read_text())["production"]["next"]["step_s"] == 1.0


def test_a_process_stopped_before_printing_is_a_stop_not_a_failure():
    with pytest.raises(device_budget.CapReached):
        device_steps.run_json("import time; time.sleep(30)", timeout=1)


def test_the_scratch_folder_is_outside_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    work = dc.scratch(None, out)
    try:
        assert work.is_dir() and out not in work.parents and work != out
    finally:
        work.rmdir()
    with pytest.raises(cli.UsageError, match="inside OUT"):
        dc.scratch(str(out / "work"), out)
    assert dc.scratch(str(tmp_path / "elsewhere"), out).is_dir()


def test_out_keeps_only_bounded_results():
    long = "x" * (device_report.OUT_STRING_LIMIT + 500) + "the end"
    got = device_report.bounded({"a": [long, 1], "b": {"c": long}})
    assert got["a"][0].endswith("the end") and len(got["a"][0]) == device_report.OUT_STRING_LIMIT + 3
    assert got["a"][1] == 1 and got["b"]["c"] == got["a"][0]


def test_the_report_lists_each_item_with_its_prediction_and_outcome():
    res = {"budget_s": 470, "plan": [["production/eager", 93.0, 216], ["reference", 34.0, 98], ["run", 130.0, 290]],
           "production": {"eager": {"step_s": 0.4, "took_s": 80.2}},
           "reference": {"stopped": "stopped at its cap (98 s)", "took_s": 98.1},
           "run": {"skipped": "130 s of budget needed, 20 s left"}}
    md = "\n".join(device_report.plan_table(res))
    assert "| production/eager | 93 | 216 | 80 | ran |" in md
    assert "| reference | 34 | 98 | 98 | stopped: stopped at its cap (98 s) |" in md
    assert "| run | 130 | 290 | - | skipped: 130 s of budget needed, 20 s left |" in md


def test_a_reference_measurement_stopped_at_its_deadline_reports_its_rounds():
    """reference_bench stops at its deadline at a round's end: the rounds done make the result;
    none done says so instead of a ratio."""
    base = {"device": "CPU", "threads": 2, "torch": "2", "context_tokens": [1], "target_tokens": [1],
            "warmup_s": {"octfm bf16": 1.0, "vjepa2 bf16": 1.0}}
    res = {**base, "times": {"octfm bf16": [0.1], "vjepa2 bf16": [0.2]},
           "stopped": "the deadline passed after 1 of 5 rounds"}
    res, lines = reference_bench.summarise(res, "/nowhere", "", "tiny", precision="bf16")
    assert res["ratio"] == {"octfm bf16": pytest.approx(2.0)} and "Stopped early" in lines[2]
    res, lines = reference_bench.summarise({**base, "times": {"octfm bf16": [], "vjepa2 bf16": []},
                                            "stopped": "the deadline passed in the warm-up"}, "/nowhere", "", "tiny",
                                           precision="bf16")
    assert res["ratio"] == {} and "no timed round (the deadline passed in the warm-up)" in lines[-1]
    assert "octfm / vjepa2: not measured" in device_report.verdicts({"reference": res})[2]


def test_the_stem_convolution_is_timed_with_cudnn_benchmark_off_and_on(tmp_path):
    """The dry run's version: the CPU at tiny sizes (the flag changes nothing there)."""
    ctx = {"sizes": dc.Sizes(True), "deadline": time.monotonic() + 120}
    r = device_steps.stem_conv(ctx)
    assert r["stem"] == [16] and r["off"]["step_ms"] > 0 and r["on"]["first_s"] > 0 and r["off_over_on"] > 0
    md = "\n".join(device_report.markdown({"stem_conv": r}))
    assert "torch.backends.cudnn.benchmark" in md and "| on |" in md


@pytest.mark.slow  # a device check stopped by a signal, about 4 s: the heavy lane
def test_a_stopped_call_removes_its_scratch_folder(tmp_path):
    """`timeout` sends SIGTERM: the scratch folder goes in the `finally`, and OUT holds results only."""
    out, work = tmp_path / "out", tmp_path / "scratch"
    p = subprocess.Popen([sys.executable, "-m", "bench.device_check", "--dry-run", "--only", "run", "--out", str(out),
                          "--work", str(work)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (work / "dataset").exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert (work / "dataset").exists(), p.communicate()[0][-3000:]
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode != 0 and not work.exists()
    assert {f.name for f in out.iterdir()} <= {"device_check.json", "device_check.md"}


@pytest.mark.slow  # about 15 s of CPU (a minute on a busy 2-core machine): dynamo traces five block graphs
def test_blocks_compiled_on_their_own_share_one_graph_per_signature():
    """What the compiled variant's cost rests on (bench/compile_cost.py): a step's 48 block calls
    have five distinct input signatures, dynamo compiles one graph for each and every other block
    reuses it, and five stays under its recompile limit (past it a block would run eager)."""
    code = "import json; from bench import compile_cost as c; c.route_as_cuda(); print(json.dumps(c.reuse()))"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]  # (a process of its own: the routing is process-wide)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["block_calls"] == 48 and got["signatures"] == got["dynamo_graphs"] == 5
    assert got["dynamo_graphs"] <= got["recompile_limit"]
