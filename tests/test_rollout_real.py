"""benchmarks/rollout.py --model: APRIL against sync on a checkpoint, the real prompts and tokenizer,
the JAX engine. A tiny random Llama with SmolLM2's tokenizer stands in for the real weights (the
comparison is the same code; the real runs are in docs/performance.md), and its figures must
hold together: the speedup is the ratio of the two rates, each rate its tokens over its time,
every delivered response counted, nothing dropped, the step costs and the ceiling one another's."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from april_jax import assets
from april_jax.rollout.vllm.server import TOKENIZER_FILES
from hf_utils import save_tiny

ROOT = Path(__file__).resolve().parents[1]
GROUPS, SAMPLES, SLOTS, STEPS, WARMUP, MAX_RESPONSE = 1, 4, 8, 2, 1, 16


@pytest.fixture(scope="module")
def tiny_llama_with_smollm2_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_smollm2")
    save_tiny(
        path,
        "llama",
        vocab_size=49152,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    source = assets.smollm2_135m_instruct()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, path / name)
    return path


@pytest.mark.slow
def test_real_prompts_on_the_jax_engine_report_consistent_figures(tiny_llama_with_smollm2_tokenizer):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.rollout",
            "--engine",
            "jax",
            "--model",
            str(tiny_llama_with_smollm2_tokenizer),
            "--steps",
            str(STEPS),
            "--warmup-steps",
            str(WARMUP),
            "--groups",
            str(GROUPS),
            "--samples",
            str(SAMPLES),
            "--slots",
            str(SLOTS),
            "--max-response-len",
            str(MAX_RESPONSE),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "rollout_real" and out["engine"] == "jax" and out["slots"] == SLOTS
    assert (out["over_sampling"], out["refill"], out["inflight"]) == (64, "members", "auto")  # APRIL as shipped
    april, sync = out["april"], out["sync"]
    assert out["delivered_speedup"] == pytest.approx(
        april["delivered_tokens_per_s"] / sync["delivered_tokens_per_s"], abs=0.002
    )
    responses = GROUPS * SAMPLES * (STEPS - WARMUP)
    for run in (april, sync):
        steady = run["time_s"] - run["compile_s"]  # both rounded to 0.01 s
        assert (
            run["delivered_tokens"] / (steady + 0.011)
            <= run["delivered_tokens_per_s"]
            <= run["delivered_tokens"] / (steady - 0.011)
        )
        assert (
            run["delivered_tokens"] / (run["time_s"] + 0.006)
            <= run["delivered_tokens_per_s_with_compiles"]
            <= run["delivered_tokens"] / (run["time_s"] - 0.006)
        )
        lengths = run["delivered_len"]
        assert lengths["n"] == responses
        assert lengths["mean"] * lengths["n"] == pytest.approx(run["delivered_tokens"], abs=0.01 * responses)
        assert 0 < lengths["p50"] <= lengths["p90"] <= lengths["max"] <= MAX_RESPONSE
        assert run["dropped_tokens"] == 0
        assert run["warmup"]["steps"] == WARMUP
        assert 0 < run["warmup"]["delivered_tokens"] <= GROUPS * SAMPLES * WARMUP * MAX_RESPONSE
        assert 0 < run["occupancy"] <= 1
    # sync generates every token of a step in that step, from that step's weights, and keeps nothing
    assert sync["off_policy_token_frac"] == 0 and sync["buffered_tokens_end"] == 0
    assert 0 <= april["off_policy_token_frac"] < 1
    costs = {int(b): c for b, c in out["step_cost"].items()}
    assert costs and max(costs) <= SLOTS
    for b, c in costs.items():
        assert c["ms"] > 0 and c["steps"] > 0
        assert abs(c["tokens_per_s"] * c["ms"] / 1000 - b) <= 0.5 + 0.01 * b  # b / c(b), b a rounded mean
    eligible = {b: c for b, c in costs.items() if c["steps"] >= out["ceiling"]["min_steps"]}
    assert out["ceiling"]["tokens_per_s"] == max(c["tokens_per_s"] for c in eligible.values())
    assert out["ceiling"]["full_running"] == max(eligible)
    assert out["ceiling_over_sync"] == pytest.approx(
        out["ceiling"]["tokens_per_s"] / sync["delivered_tokens_per_s"], abs=0.002
    )
