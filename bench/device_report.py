"""make device-check's report: its targets, one verdict line each, the markdown, and the two result files
written after every item (bench/device_check.py measures; this file only reads its results dict)."""
from __future__ import annotations

import json

from bench import verdict

PRODUCTION = "configs/pretrain_multi_domain.yaml"
CHECK = "configs/pretrain_check_gpu.yaml"  # the learning check at GPU size (make learning-check-device)
# the targets: MFU against the measured bf16 matmul rate, octfm / vjepa2 at equal work, the data wait of a
# real run, the check's step at batch 256, and make plan's peak against the measured one
MFU_TARGET, REFERENCE_TARGET, WAIT_TARGET, CHECK_STEP_TARGET_S, PLAN_TOLERANCE = 0.40, 1.5, 0.05, 0.060, 0.10
CHECK_TARGET_S = 360  # the GPU-size learning check from a bare machine


def _measured(section: dict) -> dict:
    return {k: v for k, v in (section or {}).items() if isinstance(v, dict) and "step_s" in v}


def verdicts(res: dict) -> list[str]:
    """One line per target, each with its verdict (or why it was not measured)."""
    env = res.get("environment") or {}
    card = env.get("device", "?")
    lines = []
    prod = _measured(res.get("production"))
    scored = {k: v for k, v in prod.items() if "mfu" in v}
    if scored:
        name, best = max(scored.items(), key=lambda kv: kv[1]["mfu"])
        lines.append(f"MFU of the production (ViT-B) step in bf16 at batch {best['batch']}, best variant {name}: "
                     f"{100 * best['mfu']:.1f}% of the {card}'s measured bf16 matmul rate "
                     f"({env.get('matmul_bf16_tflops', 0):.0f} TFLOP/s; target >= {100 * MFU_TARGET:.0f}%): "
                     f"{verdict(best['mfu'] >= MFU_TARGET)}")
    else:
        lines.append(f"MFU: not measured ({(res.get('production') or {}).get('error', 'no result')})")
    planned = {k: v for k, v in prod.items() if v.get("peak_over_plan")}
    if planned:
        worst = max(planned.values(), key=lambda v: abs(v["peak_over_plan"] - 1))
        lines.append("make plan's peak against the measured peak: " + ", ".join(
            f"{k} {v['peak_gib']:.1f} / {v['plan_peak_gib']:.1f} GiB" for k, v in planned.items())
            + f" (target within {100 * PLAN_TOLERANCE:.0f}%): {verdict(abs(worst['peak_over_plan'] - 1) <= PLAN_TOLERANCE)}")
    else:
        lines.append("make plan against the measured peak: not measured (no GPU memory reading)")
    ref = res.get("reference") or {}
    if ref.get("ratio"):
        name, ratio = max(ref["ratio"].items(), key=lambda kv: kv[1])
        lines.append(f"octfm / vjepa2 at equal work ({name}): {ratio:.2f}x (target >= {REFERENCE_TARGET}x): "
                     f"{verdict(ratio >= REFERENCE_TARGET)}")
    else:
        lines.append(f"octfm / vjepa2: not measured ({ref.get('skipped') or ref.get('stopped') or ref.get('error') or 'no result'})")
    ck = _measured(res.get("check"))
    if ck:
        name, best = min(ck.items(), key=lambda kv: kv[1]["step_s"])
        lines.append(f"the check's step at batch {best['batch']}: " + ", ".join(
            f"{k} {1000 * v['step_s']:.1f} ms" for k, v in ck.items())
            + f" (target <= {1000 * CHECK_STEP_TARGET_S:.0f} ms): {verdict(best['step_s'] <= CHECK_STEP_TARGET_S)}; "
            f"its pretraining at the best step {best['pretrain_s']:.0f} s of the whole check's {CHECK_TARGET_S} s")
    else:
        lines.append(f"the check's step: not measured ({(res.get('check') or {}).get('error', 'no result')})")
    run = res.get("run") or {}
    if "data_wait_frac" in run:
        w = run["data_wait_frac"]
        lines.append(f"data wait in a real make pretrain ({run['steps']} steps, {run['workers']} loader workers, "
                     f"production crop): {100 * w:.1f}% of the step (target < {100 * WAIT_TARGET:.0f}%): "
                     f"{verdict(w < WAIT_TARGET)}")
    else:
        why = run.get("error") or run.get("skipped") or run.get("stopped") or "no result"
        lines.append(f"data wait: not measured ({why})")
    ct = res.get("cuda_tests") or {}
    if "tests" in ct:
        lines.append(f"CUDA tests: {ct['passed']} passed, {len(ct['failed'])} failed {ct['failed'] or ''}, "
                     f"{ct['skipped']} skipped")
    return lines


def _num(v, fmt: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, fmt)


def step_table(steps: dict, title: str) -> list[str]:
    """A section's measured steps (step_size's records) as a table; a skipped or failed variant says why."""
    if not steps:
        return []
    md = [f"## {title}", "", "| variant | params | batch | tokens/sample | step (ms) | tokens/s | GFLOP/step | "
          "achieved TFLOP/s | MFU (measured matmul) | GPU busy | peak GiB | plan GiB | first step (s) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, v in steps.items():
        if not isinstance(v, dict):
            continue
        if "step_s" not in v:
            state = next((s for s in ("skipped", "stopped") if s in v), "failed")
            why = v.get(state) or v.get("error") or "?"
            md.append(f"| {k} | {state}: {why[:200]} |" + " |" * 11)
            continue
        md.append(f"| {k} | {v['params_m']:.1f} M | {v['batch']} | {v['tokens']} | {1000 * v['step_s']:.1f} | "
                  f"{v['tokens_per_s']:.0f} | {_num(v.get('flops_per_step'), '.0f', 1e-9)} | "
                  f"{_num(v.get('achieved_tflops'), '.1f')} | {_num(v.get('mfu'), '.1%')} | "
                  f"{_num(v.get('gpu_busy_frac'), '.0%')} | {_num(v.get('peak_gib'), '.1f')} | "
                  f"{_num(v.get('plan_peak_gib'), '.1f')} | {v['first_step_s']:.1f} |")
    return md + [""]


def profile_table(steps: dict, title: str) -> list[str]:
    """Where the profiled steps' time goes (profile_summary's records)."""
    rows = {k: v for k, v in steps.items()
            if isinstance(v, dict) and any(x in v for x in ("profile_top", "profile_error", "late_error"))}
    if not rows:
        return []
    md = [f"## {title}", ""]
    for k, v in rows.items():
        if "profile_top" not in v:
            why = v.get("profile_error") or (v["late_error"].strip().splitlines() or ["?"])[-1][:300]
            md += [f"{k}: not profiled ({why})", ""]
            continue
        busy = v.get("gpu_busy_frac")
        where = ("" if busy is None else
                 f"kernels {v['profile_device_ms_per_step']:.1f} ms per step against {1000 * v['step_s']:.1f} ms "
                 f"unprofiled: the GPU is busy {100 * busy:.0f}% of a step ({'the host sets the pace' if busy < 0.7 else 'the GPU sets the pace'}); ")
        launches = f", {v['profile_kernels_per_step']:.0f} kernel launches" if "profile_kernels_per_step" in v else ""
        md += [f"{k}: {where}host time in ops and runtime calls (its waits left out) {v['profile_host_ms_per_step']:.1f} ms "
               f"per step, {v['profile_op_calls_per_step']:.0f} aten op calls{launches} per step.", "",
               f"| {'kernel' if busy is not None else 'op'} | {'device' if busy is not None else 'host'} ms per step | "
               "calls per step |", "|---|---|---|",
               *(f"| `{name}` | {ms:.2f} | {n:g} |" for name, ms, n in v["profile_top"]), ""]
    return md


def markdown(res: dict) -> list[str]:
    env = res.get("environment") or {}
    md = [f"# make device-check: {env.get('device', '?')}{' (DRY RUN: CPU, tiny sizes)' if res.get('dry_run') else ''}",
          "", f"torch {env.get('torch')}, CUDA {env.get('cuda')}, {env.get('cpus')} CPUs; bf16 matmul measured "
              f"{env.get('matmul_bf16_tflops', 0):.1f} TFLOP/s (datasheet {env.get('datasheet_bf16_tflops')}); "
              f"torch built for {','.join(env.get('arch_list') or []) or '-'}; "
              f"{res.get('when')}; total {res.get('total_s', 0):.0f} s", ""]
    for key, title in (("production", f"The production step ({PRODUCTION}, ViT-B, bf16)"),
                       ("check", f"The GPU-size learning check's pretraining step ({CHECK}, bf16)")):
        md += step_table(res.get(key) or {}, title)
        md += profile_table(_measured(res.get(key)), f"{title}: where a step's time goes (torch.profiler)")
    ref = res.get("reference") or {}
    if ref.get("markdown"):
        md += ref["markdown"] + [""]
    stem = res.get("stem_conv") or {}
    if "off" in stem:
        on = stem.get("on") or {}
        md += [f"## The stem's 3D convolution (model.stem {stem['stem']}, batch {stem['batch']}, "
               f"{'x'.join(map(str, stem['crop']))}, bf16, forward and backward), torch.backends.cudnn.benchmark", "",
               "| benchmark | first call (s) | step (ms) |", "|---|---|---|",
               *(f"| {k} | {v['first_s']:.2f} | {v['step_ms']:.2f} |" for k, v in (("off", stem["off"]), ("on", on)) if v),
               ""]
    run = res.get("run") or {}
    if "data_wait_frac" in run:
        md += ["## A real make pretrain (production config and crop, volumes from disk, default workers)", "",
               f"{run['steps']} steps of {run['batch']} in {run.get('run_s', 0):.0f} s (startup "
               f"{_num(run.get('startup_s'), '.1f')} s): {run['run_samples_per_s']:.1f} samples/s, data wait "
               f"{100 * run['data_wait_frac']:.1f}% of the step with {run['workers']} loader workers.", ""]
    for name, v in res.items():
        if isinstance(v, dict) and v.get("error"):
            md += [f"Section {name} failed: `{v['error'][:300]}`", ""]
    md += ["## Verdicts", "", *(f"- {v}" for v in verdicts(res))]
    return md + plan_table(res)


def _outcome(r: dict | None) -> str:
    if not isinstance(r, dict):
        return "not reached"
    for state in ("skipped", "stopped"):
        if isinstance(r.get(state), str):  # (the CUDA tests' `skipped` is a count)
            return f"{state}: {r[state]}"[:160]
    return "failed" if r.get("error") else "ran"


def plan_table(res: dict) -> list[str]:
    """Each item's predicted cost and cap beside what it took and how it ended: what the next
    call's predictions (bench/device_budget.py, predicted_costs) should be corrected by."""
    if not res.get("plan"):
        return []
    md = ["", f"## The budget ({res.get('budget_s', 0):.0f} s): predicted, capped, taken", "",
          "| item | predicted (s) | cap (s) | took (s) | outcome |", "|---|---|---|---|---|"]
    for key, predicted, cap in res["plan"]:
        section, _, variant = key.partition("/")
        r = res.get(section)
        r = r.get(variant) if variant and isinstance(r, dict) else r
        took = r.get("took_s") if isinstance(r, dict) else None
        md.append(f"| {key} | {predicted:.0f} | {cap:.0f} | {_num(took, '.0f')} | {_outcome(r)} |")
    return md


OUT_STRING_LIMIT = 6000  # characters of any one string in device_check.json: OUT comes back from the GPU machine


def bounded(value):
    """`value` with every long string cut to its last OUT_STRING_LIMIT characters (errors end there)."""
    if isinstance(value, str) and len(value) > OUT_STRING_LIMIT:
        return "..." + value[-OUT_STRING_LIMIT:]
    if isinstance(value, dict):
        return {k: bounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [bounded(v) for v in value]
    return value


def write_results(ctx: dict, name: str | None = None, partial: dict | None = None) -> None:
    if name is not None:
        ctx["results"][name] = partial
    results = bounded(ctx["results"])
    (ctx["out"] / "device_check.json").write_text(json.dumps(results, indent=2, default=str))
    (ctx["out"] / "device_check.md").write_text("\n".join(markdown(results)) + "\n")
