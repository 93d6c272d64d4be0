"""The device check's two bookends (scripts/device_check.sh).

    python -m benchmarks.gpu_summary env                  # one JSON line: versions, devices, GPU
    python -m benchmarks.gpu_summary summarize WORK OUT   # WORK's pieces -> OUT (the summary JSON)

`summarize` reads what the script left in WORK: items.jsonl (one line per step: name, rc,
seconds, status), env.out, junit_*.xml (pytest outcomes) and *.out (benchmark JSON lines), and
writes one JSON with every figure, every test outcome and the goals judged. It imports no JAX,
so it runs even when JAX cannot start.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

GOAL_MFU = 0.45
GOAL_ENGINE_FRACTION_AT_64 = 0.60
PACKAGES = (
    "jax",
    "jaxlib",
    "jax-cuda13-plugin",
    "jax-cuda12-plugin",
    "flax",
    "optax",
    "orbax-checkpoint",
    "torch",
    "transformers",
    "safetensors",
    "numpy",
    "ml-dtypes",
    "pytest",
)


def environment() -> dict:
    env = {"python": platform.python_version(), "executable": sys.executable, "packages": {}}
    for name in PACKAGES:
        try:
            env["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        env["nvidia_smi"] = f"unavailable: {e}"
    try:
        import jax

        env["jax_backend"] = jax.default_backend()
        env["jax_devices"] = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
    except Exception as e:  # the check goes on and reports it
        env["jax_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    try:
        import torch

        env["torch_cuda"] = torch.cuda.is_available()
        if env["torch_cuda"]:
            env["torch_device"] = torch.cuda.get_device_name(0)
            env["torch_cuda_version"] = torch.version.cuda
    except Exception as e:
        env["torch_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    return env


def json_lines(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return rows


def junit_outcomes(path: Path) -> dict:
    """{"counts": {outcome: n}, "cases": [...]} from a pytest --junitxml file."""
    if not path.exists():
        return {"counts": {}, "cases": [], "error": f"{path.name} missing (pytest did not finish)"}
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "")[:1500]
                break
        cases.append(
            {"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0), "message": message}
        )
    counts: dict[str, int] = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    return {"counts": counts, "cases": cases}


def goals(benchmarks: dict, mode: str) -> dict:
    """The goals (train-step MFU, engine decode vs roofline), judged only on a GPU (a dry run's figures are CPU noise)."""
    judged = mode == "gpu"
    mfus = [r["mfu"] for r in benchmarks.get("gpu_train_mfu", []) if "mfu" in r]
    at64 = [
        r["fraction_of_roofline"]
        for r in benchmarks.get("gpu_engine_decode", [])
        if r.get("batch") == 64 and "fraction_of_roofline" in r
    ]
    return {
        "train_step_mfu": {
            "goal": GOAL_MFU,
            "best": max(mfus, default=None),
            "met": (max(mfus) >= GOAL_MFU) if judged and mfus else None,
        },
        "engine_decode_fraction_of_roofline_at_batch_64": {
            "goal": GOAL_ENGINE_FRACTION_AT_64,
            "value": at64[0] if at64 else None,
            "met": (at64[0] >= GOAL_ENGINE_FRACTION_AT_64) if judged and at64 else None,
        },
    }


def summarize(work: Path, out: Path, mode: str, budget_s: float, elapsed_s: float) -> dict:
    items = json_lines(work / "items.jsonl")
    env = (json_lines(work / "env.out") or [{}])[-1]
    tests = {p.stem.removeprefix("junit_"): junit_outcomes(p) for p in sorted(work.glob("junit_*.xml"))}
    for item in items:  # a pytest run that died before writing its XML still shows up
        if item["name"].startswith("tests_") and item["name"].removeprefix("tests_") not in tests:
            tests[item["name"].removeprefix("tests_")] = junit_outcomes(work / f"junit_{item['name'][6:]}.xml")
    benchmarks: dict[str, list] = {}
    for item in items:
        if item["name"].startswith("gpu_"):
            rows = json_lines(work / f"{item['name']}.out")
            benchmarks.setdefault(rows[0]["benchmark"] if rows else item["name"], []).extend(rows)
    bad_tests = sum(t["counts"].get("failed", 0) + t["counts"].get("error", 0) + ("error" in t) for t in tests.values())
    bad_rows = sum("error" in r for rows in benchmarks.values() for r in rows)
    # a step left out on purpose (a dry run, a missing optional asset) is listed, not a failure;
    # one the time budget cut off is a failure
    chosen_skips = [i["name"] for i in items if i["status"].startswith("skipped:") and "time budget" not in i["status"]]
    bad_items = [i["name"] for i in items if i["status"] != "ok" and i["name"] not in chosen_skips]
    summary = {
        "check": "april_jax device check",
        "mode": mode,
        "budget_s": budget_s,
        "elapsed_s": round(elapsed_s, 1),
        "env": env,
        "items": items,
        "tests": tests,
        "benchmarks": benchmarks,
        "goals": goals(benchmarks, mode),
        "problems": {
            "failed_or_errored_tests": bad_tests,
            "benchmark_rows_with_error": bad_rows,
            "items_not_ok": bad_items,
            "items_skipped_on_purpose": chosen_skips,
        },
        "ok": not (bad_tests or bad_rows or bad_items),
    }
    out.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main():
    if sys.argv[1:2] == ["env"]:
        print(json.dumps(environment()), flush=True)
    elif sys.argv[1:2] == ["summarize"] and len(sys.argv) == 7:
        work, out, mode, budget, elapsed = sys.argv[2:]
        s = summarize(Path(work), Path(out), mode, float(budget), float(elapsed))
        counts = {k: v["counts"] for k, v in s["tests"].items()}
        print(
            f"device check ({mode}): ok={s['ok']} tests={counts} problems={s['problems']} goals="
            f"{json.dumps({k: v.get('met') for k, v in s['goals'].items()})} -> {out}"
        )
        sys.exit(0 if s["ok"] else 1)
    else:
        sys.exit("usage: gpu_summary.py env | summarize WORK OUT MODE BUDGET_S ELAPSED_S")


if __name__ == "__main__":
    main()
