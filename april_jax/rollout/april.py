"""APRIL: over-sampling, active termination, a partial buffer and token-level resume.

One `collect` call is one training step's rollout, on any engine with the common interface:

1. Drain the buffer first: groups that completed beyond last step's target are delivered (if
   still within the staleness cap); unfinished groups resume their unfinished members at token
   level (prompt ids + generated ids, `max_new_tokens = max_response_len - generated`).
2. Keep `over_sampling_batch_size` groups in flight: fresh prompts fill up to it, and refill it
   when a group is filtered out (DAPO dynamic sampling) or lost to the staleness policy. A resumed
   group counts by its unfinished members (k of n counts k/n; `resume_count="group"`: whole, as
   slime), so the engine is as full after a resume as in a fresh step. With `refill="members"` (the
   default) the budget is the unfinished requests / n instead, refilled as members finish: the
   engine stays full all step (docs/performance.md, "APRIL vs synchronous rollout under a roofline
   cost model"), and `inflight="auto"` (the default) sizes the requests in flight by the staleness cap.
3. A group counts when all its `n_samples_per_prompt` members are finished (stop, or truncated at
   the budget) and scored. The moment `rollout_batch_size` groups count, every other request is
   aborted; unfinished groups go to the buffer whole, with every token's behaviour logprob and version.

Rewards: a finished group is handed to `reward_fn.submit_group(group)` (a `RewardModel` scoring in
worker processes) and counts once its scores are back, so a slow verifier runs beside generation
instead of inside it; a plain `reward_fn(sample, prompt) -> float` is called inline instead.

The synchronous baseline is the same code with `over_sampling_batch_size == rollout_batch_size`
and `partial_rollout=False` (which also means `refill="groups"`, `inflight="over_sampling"`: a
synchronous step starts its groups at once and waits for all of them).
One design on every engine: what benchmarks/rollout.py measures as APRIL is these defaults. Every drawn prompt is either delivered once, still buffered, or
counted in `dropped` with a reason (filtered, stale, evicted).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from typing import Callable, Iterator

import numpy as np

from april_jax.data.types import PromptRecord
from april_jax.rollout.buffer import PartialBuffer
from april_jax.rollout.engine import EngineProtocol, EngineStats
from april_jax.rollout.types import Group, Request, Result, Sample, SamplingParams
from april_jax.schema import check_fields, internal, key

RewardFn = Callable[[Sample, PromptRecord], float]  # or an object with submit_group(group) -> pending scores


class _Scored:
    """Scores computed inline (a plain reward function): already done."""

    def __init__(self, rewards: list[float]):
        self.rewards = rewards
        self.futures = ()

    def done(self) -> bool:
        return True

    def result(self) -> list[float]:
        return self.rewards


@dataclasses.dataclass
class RolloutConfig:
    """APRIL's settings; each field but stop_token_ids is the config key `rollout.<field>`."""

    rollout_batch_size: int = key(32, "prompt groups delivered to each train step", gt=0)
    n_samples_per_prompt: int = key(8, "responses per prompt (the GRPO group size)", gt=0)
    over_sampling_batch_size: int = key(64, "prompt groups kept in flight; = rollout_batch_size (with "
                                            "partial_rollout=false): the synchronous baseline", gt=0)
    partial_rollout: bool = key(True, "keep aborted groups in the buffer and resume them next step (APRIL); "
                                      "false: discard them")
    max_response_len: int = key(1024, "generation budget per response, in tokens (a resumed response counts "
                                      "what it already generated)", gt=0)
    max_staleness: int = key(4, "policy versions a buffered token may lag (4: a response spans at most 5); older ones are restarted/dropped "
                                "(stale_policy) and masked in the loss", ge=0)
    stale_policy: str = key("restart", "a buffered member past max_staleness: regenerate it from the prompt, "
                                       "or drop its whole group", choices=("restart", "drop_group"))
    dynamic_sampling: bool = key(False, "DAPO dynamic sampling: drop groups whose rewards are all equal "
                                        "(zero advantage) and draw more prompts")
    schedule: str = key("fifo", "submission order of buffered groups: as they came, or shortest remaining first "
                                "(by the prompt's past response lengths)", choices=("fifo", "short_first"))
    # "groups": delivered + in-flight groups, a resumed group by `resume_count`; the engine drains
    # as members finish and refills only when a group is dropped (the paper's). "members":
    # unfinished requests / n_samples_per_prompt, refilled as members finish.
    refill: str = key("members", "how the in-flight budget is counted: by groups (the paper's: refilled when a "
                                "group is dropped) or by unfinished members (refilled as they finish)",
                      choices=("groups", "members"))
    resume_count: str = key("fraction", "a resumed group with k of n members unfinished counts k/n of the "
                                        "budget, or 1 ('group', as slime)", choices=("fraction", "group"))
    # "auto" also caps the in-flight requests so that a max_response_len response finishes within
    # its cap (a response advances one token per decode step: R requests in flight make a step of
    # D delivered tokens last D / R decode steps, so R <= steps x D / max_response_len, D measured,
    # steps = max_staleness + 1 - the fraction of the step gone when it starts; no fresh start past
    # late_start_cutoff) and, on an engine that reports its KV budget
    # (`kv_budget_tokens`, the simulated replicas), so that their contexts fit it.
    inflight: str = key("auto", "requests in flight: over_sampling_batch_size x n_samples_per_prompt, or "
                                         "'auto': also as few as let a full-length response finish within "
                                         "its staleness cap (and fit the KV budget)",
                        choices=("over_sampling", "auto"))
    # A response must finish within max_staleness + 1 steps counted from the step it starts in, so a
    # fresh group started late in a step has nearly a step less than one started at its start.
    late_start_cutoff: float = key(0.7, "inflight='auto': no fresh group starts once this fraction of the step's "
                                        "groups is delivered (a later start has fewer steps before the staleness "
                                        "cap); 1: no cutoff", gt=0, le=1)
    # The staleness cap throws away a whole group when its longest member misses it by a little (its
    # finished members too); these two let the nearly-late ones through. The wait is counted in the
    # engine's decode steps, not seconds, so that a seeded run stays deterministic on a real engine.
    finish_wait: float = key(1.0, "inflight='auto': once the step's groups are delivered, keep generating (no fresh "
                                  "start) for up to this many mean steps' worth of decode steps while a response that would pass "
                                  "max_staleness at the next step is in flight; a group finished then takes the "
                                  "place of the freshest delivered one, which waits in the buffer; 0: off", ge=0,
                             finite=True)
    inflight_headroom: float = key(0.75, "inflight='auto': steps of time added to the staleness sizing of the "
                                         "requests in flight (more in flight, more responses finished late, which "
                                         "finish_wait saves)", ge=0, finite=True)
    buffer_capacity: int = key(1024, "most groups the partial buffer holds; the oldest are evicted beyond it", gt=0)
    temperature: float = key(1.0, "sampling temperature (0: greedy); the loss's logprobs use the same one",
                             ge=0, finite=True)
    top_p: float = key(1.0, "nucleus sampling: keep the smallest token set with this much probability", gt=0, le=1)
    top_k: int = key(0, "sample among the k most likely tokens; 0: all", ge=0)
    stop_token_ids: tuple[int, ...] = internal((), "token ids that end a response (from the task's tokenizer)")

    def validate(self) -> "RolloutConfig":
        check_fields(self, "rollout")
        if self.over_sampling_batch_size < self.rollout_batch_size:
            raise ValueError(f"rollout.over_sampling_batch_size={self.over_sampling_batch_size}: must be >= "
                             f"rollout.rollout_batch_size={self.rollout_batch_size}")
        return self

    @property
    def waits_to_finish(self) -> bool:
        """finish_wait acts (and APRIL keeps its step-time clock) only here."""
        return self.inflight == "auto" and self.partial_rollout and self.finish_wait > 0


class April:
    def __init__(self, cfg: RolloutConfig, prompts: Iterator[PromptRecord], reward_fn: RewardFn | None = None):
        cfg = cfg.validate()
        if not cfg.partial_rollout:  # the synchronous baseline: no refill, nothing sized by a cap it has not
            cfg = dataclasses.replace(cfg, refill="groups", inflight="over_sampling")
        self.cfg = cfg
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.buffer = PartialBuffer(cfg.buffer_capacity)
        self.next_group = 0
        self.drawn = 0
        self.dropped: dict[str, str] = {}  # prompt uid -> reason
        self.length_history: dict[str, float] = {}  # prompt key -> mean response length seen
        self.exhausted = False
        # delivered responses so far, for inflight="auto": count, tokens, sum of the contexts their tokens read
        self.seen = {"responses": 0, "tokens": 0, "ctx": 0}
        self.step_time = [0, 0]  # engine decode steps of the steps so far, and their number (finish_wait's unit)

    # ---- the step ----
    def collect(self, engine: EngineProtocol, version: int) -> tuple[list[Group], dict]:
        cfg, target = self.cfg, self.cfg.rollout_batch_size
        t0, s0 = engine.now(), engine.stats()
        m = dict(aborted=0, resumed=0, dropped_tokens=0, stale_restarts=0, stale_dropped_groups=0,
                 zero_std_groups=0, evicted_groups=0, reward_wait_s=0.0, late_start=-1.0, swapped=0)
        delivered: list[Group] = []
        surplus: list[Group] = []
        inflight: dict[str, Group] = {}
        scoring: dict[str, tuple[Group, object]] = {}  # finished groups whose rewards are being computed
        requests: dict[str, Sample] = {}
        weight: dict[str, float] = {}  # group id -> its share of the in-flight budget

        def submit(groups: list[Group]) -> None:
            batch = []
            for g in self._ordered(groups):
                for s in g.samples:
                    if s.finished:
                        continue
                    if s.response_ids:
                        m["resumed"] += 1
                    request = self._request(s)
                    requests[request.request_id] = s
                    s.status, s.segments = "running", s.segments + 1
                    batch.append(request)
            engine.submit(batch)

        limit = self.inflight_limit(engine)

        def progress() -> float:  # fraction of the step's groups delivered: where in the step a start falls
            return len(delivered) / target

        def room(new_groups: int) -> bool:
            if len(requests) + (new_groups + 1) * cfg.n_samples_per_prompt > self.inflight_limit(engine, progress()):
                return False
            if cfg.refill == "members":  # new groups are not submitted yet: count their members too
                if len(delivered) + len(scoring) >= target:
                    return False  # enough groups finished: the step waits on rewards, not on the engine
                return len(requests) / cfg.n_samples_per_prompt + new_groups < cfg.over_sampling_batch_size
            # A buffered group with k unfinished members counts k/n (by default): the engine keeps as
            # many requests in flight as a fresh over-sampled step would (not just 1-2 per long group).
            # Finished groups waiting for their rewards still count.
            return (len(delivered) + sum(weight[gid] for gid in inflight) + sum(weight[gid] for gid in scoring)
                    < cfg.over_sampling_batch_size)

        def too_late() -> bool:
            """inflight=auto, past the cutoff: a fresh response would have too few steps before its cap;
            one still starts if the groups in flight could not meet the target without it."""
            return (cfg.inflight == "auto" and progress() >= cfg.late_start_cutoff
                    and len(inflight) + len(scoring) >= target - len(delivered))

        def fresh_groups() -> list[Group]:
            out = []
            while room(len(out)) and len(delivered) < target and not too_late():
                g = self._new_group()
                if g is None:
                    break
                inflight[g.group_id] = g
                weight[g.group_id] = 1.0
                out.append(g)
                m["late_start"] = max(m["late_start"], progress())
            return out

        def accept(g: Group) -> None:
            if cfg.dynamic_sampling and len({s.reward for s in g.samples}) == 1:
                m["zero_std_groups"] += 1
                self.dropped[g.prompt.uid] = "filtered"
            elif len(delivered) < target:
                delivered.append(g)
            elif cfg.inflight == "auto" and cfg.finish_wait > 0 and self._group_at_risk(g, version):
                # it would be past the cap at the next step: it takes the place of the freshest delivered
                # group that would not, which waits in the buffer instead (the target and cap still hold)
                fresh = [x for x in delivered if not self._group_at_risk(x, version)]
                if fresh:
                    x = max(fresh, key=lambda x: min(self._first_version(s, version) for s in x.samples))
                    delivered.remove(x)
                    surplus.append(x)
                    delivered.append(g)
                    m["swapped"] += 1
                else:
                    surplus.append(g)
            else:
                surplus.append(g)

        def score(g: Group) -> None:
            scoring[g.group_id] = (g, self._submit_scores(g))

        def harvest(block: bool = False) -> None:
            """Accept the groups whose rewards are back (all of them when `block`)."""
            for gid, (g, pending) in list(scoring.items()):
                if block or pending.done():
                    for s, r in zip(g.samples, pending.result()):
                        s.reward = float(r)
                    del scoring[gid]
                    accept(g)

        # 1. the buffer first
        resumed = []
        for g in self.buffer.drain():
            if not self._within_staleness(g, version, m):
                continue
            if g.complete:
                weight[g.group_id] = 0.0
                accept(g) if all(s.reward is not None for s in g.samples) else score(g)
            else:
                inflight[g.group_id] = g
                unfinished = sum(not s.finished for s in g.samples)
                weight[g.group_id] = 1.0 if cfg.resume_count == "group" else unfinished / cfg.n_samples_per_prompt
                resumed.append(g)
        submit(resumed)
        submit(fresh_groups())

        # 2. generate until the target is met; finished groups are scored beside the engine
        while len(delivered) < target and (engine.has_unfinished() or scoring):
            if engine.has_unfinished():
                for result in engine.step():
                    sample = requests.pop(result.request_id)
                    group = inflight[sample.group_id]
                    self._absorb(sample, result, group.prompt)
                    if group.complete:
                        del inflight[group.group_id]
                        score(group)
            else:  # nothing to generate until rewards decide what counts
                t = time.perf_counter()
                self._wait_any([p for _, p in scoring.values()])
                m["reward_wait_s"] += time.perf_counter() - t
            harvest()
            submit(fresh_groups())

        # 2b. (inflight=auto) before terminating, let the responses that would pass their cap at the next
        # step finish (restarting one throws away its group's tokens); nothing fresh starts meanwhile
        m["finish_wait_s"] = 0.0
        if cfg.waits_to_finish and self.step_time[1]:
            wait_start = engine.now()
            deadline = engine.stats().decode_steps + cfg.finish_wait * self.step_time[0] / self.step_time[1]
            while (engine.has_unfinished() and engine.stats().decode_steps < deadline
                   and any(self._at_risk(s, version) for s in requests.values())):
                for result in engine.step():
                    sample = requests.pop(result.request_id)
                    group = inflight[sample.group_id]
                    self._absorb(sample, result, group.prompt)
                    if group.complete:
                        del inflight[group.group_id]
                        score(group)
                harvest()
            m["finish_wait_s"] = engine.now() - wait_start

        # 3. active termination
        for result in engine.abort_all():
            m["aborted"] += 1
            sample = requests.pop(result.request_id)
            self._absorb(sample, result, inflight[sample.group_id].prompt)
        t = time.perf_counter()
        harvest(block=True)  # finished groups beyond the target keep their rewards in the buffer
        m["reward_wait_s"] += time.perf_counter() - t
        for g in list(inflight.values()) + surplus:
            if not cfg.partial_rollout:
                for s in g.samples:
                    if not s.finished:
                        m["dropped_tokens"] += s.reset()
            self.buffer.put(g)
        for g in self.buffer.take_evicted():
            m["evicted_groups"] += 1
            self.dropped[g.prompt.uid] = "evicted"
            m["dropped_tokens"] += sum(len(s.response_ids) for s in g.samples)
        for g in delivered:
            self._remember_lengths(g)
        if cfg.waits_to_finish:
            self.step_time = [self.step_time[0] + engine.stats().decode_steps - s0.decode_steps, self.step_time[1] + 1]
        # the largest fraction of the step's groups delivered when a fresh group started (-1: none started)
        return delivered, {**self._metrics(delivered, version, m, engine, t0, s0), "rollout/inflight_limit": limit,
                           "rollout/fresh_start_progress_max": m["late_start"],
                           "rollout/finish_wait_s": m["finish_wait_s"], "rollout/swapped_groups": m["swapped"]}

    # ---- pieces ----
    # Fraction of the KV budget the in-flight contexts may fill on average: the sum of running
    # contexts moves around its mean, and an overflow costs a preemption (a re-prefill).
    KV_FILL = 0.85

    @staticmethod
    def _first_version(s: Sample, version: int) -> int:
        """The policy version of a response's first token (`version` if it has none yet)."""
        return min(s.response_versions) if s.response_versions else version

    def _at_risk(self, s: Sample, version: int) -> bool:
        """Past max_staleness at the next step (version + 1) unless delivered in this one."""
        return version + 1 - self._first_version(s, version) > self.cfg.max_staleness

    def _group_at_risk(self, g: Group, version: int) -> bool:
        return any(self._at_risk(s, version) for s in g.samples)

    def inflight_limit(self, engine: EngineProtocol, progress: float = 0.0) -> int:
        """Requests allowed in flight when a fraction `progress` of the step's groups is delivered
        (see RolloutConfig.inflight). A response started then has max_staleness + 1 - progress steps
        of time before its cap (the rest of this step and max_staleness more), so the limit is sized
        for those: highest at the step's start, max_staleness steps' worth at its end."""
        cfg, n = self.cfg, self.cfg.n_samples_per_prompt
        limit = cfg.over_sampling_batch_size * n
        if cfg.inflight != "auto":
            return limit
        seen = self.seen
        if not seen["responses"]:  # nothing measured yet: no more than a synchronous step starts
            limit = min(limit, cfg.rollout_batch_size * n)
        else:
            per_step = cfg.rollout_batch_size * n * seen["tokens"] / seen["responses"]
            steps = max(cfg.max_staleness + 1 - progress, 0.5) + cfg.inflight_headroom
            limit = min(limit, int(steps * per_step / cfg.max_response_len))
        budget = engine.kv_budget_tokens
        if math.isfinite(budget):
            # before anything is delivered: every running context at half the response budget
            ctx = seen["ctx"] / seen["tokens"] if seen["tokens"] else cfg.max_response_len / 2
            limit = min(limit, int(self.KV_FILL * budget / ctx))
        return max(limit, n)

    def _new_group(self) -> Group | None:
        try:
            prompt = next(self.prompts)
        except StopIteration:
            self.exhausted = True
            return None
        self.drawn += 1
        gid = f"g{self.next_group}"
        self.next_group += 1
        n = self.cfg.n_samples_per_prompt
        return Group(gid, prompt, [Sample(list(prompt.prompt_ids), gid, i) for i in range(n)])

    def _request(self, s: Sample) -> Request:
        cfg = self.cfg
        key = f"{s.group_id}/{s.index}/{s.attempt}"
        return Request(f"{key}/{s.segments}", s.prompt_ids + s.response_ids, cfg.max_response_len - len(s.response_ids),
                       SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k), cfg.stop_token_ids, sample_key=key,
                       shared_prefix_len=len(s.prompt_ids))  # the group's members prefill their prompt once

    def _absorb(self, s: Sample, r: Result, prompt: PromptRecord) -> None:
        s.response_ids += r.token_ids
        s.response_logprobs += r.logprobs
        s.response_versions += r.versions
        s.finish_reason = r.finish_reason
        if r.finish_reason == "abort":
            s.status = "aborted"
            return
        if r.finish_reason == "error":
            s.metadata["error"] = r.error
        s.status = "completed" if r.finish_reason == "stop" else "truncated"

    def _submit_scores(self, g: Group):
        if hasattr(self.reward_fn, "submit_group"):
            return self.reward_fn.submit_group(g)
        return _Scored([float(self.reward_fn(s, g.prompt)) if self.reward_fn else 0.0 for s in g.samples])

    @staticmethod
    def _wait_any(pending: list) -> None:
        """Block until one pending score may be done (its futures are concurrent.futures ones)."""
        if any(p.done() for p in pending):
            return
        futures = [f for p in pending for f in p.futures if not f.done()]
        concurrent.futures.wait(futures, timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED)

    def _within_staleness(self, g: Group, version: int, m: dict) -> bool:
        stale = [s for s in g.samples if s.staleness(version) > self.cfg.max_staleness]
        if not stale:
            return True
        if self.cfg.stale_policy == "drop_group":
            m["stale_dropped_groups"] += 1
            m["dropped_tokens"] += sum(len(s.response_ids) for s in g.samples)
            self.dropped[g.prompt.uid] = "stale"
            return False
        for s in stale:
            m["stale_restarts"] += 1
            m["dropped_tokens"] += s.reset()
        return True

    def _ordered(self, groups: list[Group]) -> list[Group]:
        if self.cfg.schedule == "fifo":
            return groups
        typical = np.median(list(self.length_history.values())) if self.length_history else 0.0
        return sorted(groups, key=lambda g: self.length_history.get(self._prompt_key(g), typical))

    @staticmethod
    def _prompt_key(g: Group) -> str:
        return g.prompt.source or ",".join(map(str, g.prompt.prompt_ids[:64]))

    def _remember_lengths(self, g: Group) -> None:
        self.length_history[self._prompt_key(g)] = float(np.mean([len(s.response_ids) for s in g.samples]))
        for s in g.samples:
            L, P = len(s.response_ids), len(s.prompt_ids)
            self.seen["responses"] += 1
            self.seen["tokens"] += L
            self.seen["ctx"] += L * P + L * (L - 1) // 2

    def _metrics(self, groups: list[Group], version: int, m: dict, engine: EngineProtocol, t0: float,
                 s0: EngineStats) -> dict:
        samples = [s for g in groups for s in g.samples]
        lengths = np.array([len(s.response_ids) for s in samples] or [0])
        versions = np.concatenate([np.asarray(s.response_versions) for s in samples] or [np.zeros(0)])
        stale = np.array([s.staleness(version) for s in samples] or [0])
        rewards = np.array([s.reward for s in samples] or [0.0], float)
        s1, elapsed = engine.stats(), engine.now() - t0
        # throughput of what the engine generated in this call (delivered responses may hold
        # tokens of earlier steps): 0 when a step is served from the buffer alone
        generated = s1.tokens_generated - s0.tokens_generated
        steps = s1.decode_steps - s0.decode_steps
        busy = s1.busy_slot_steps - s0.busy_slot_steps
        # Everything but the model: APRIL's bookkeeping and the engine's host work (engines that
        # time their device calls report model_s).
        overhead = {"rollout/host_overhead_s": elapsed - (s1.model_s - s0.model_s)} if s1.model_s is not None else {}
        if s1.model_calls is not None:
            overhead["rollout/model_calls"] = s1.model_calls - s0.model_calls
        return {
            **overhead,
            "rollout/time_s": elapsed,
            "rollout/tokens": int(lengths.sum()),
            "rollout/generated_tokens": int(generated),
            "rollout/tokens_per_s": float(generated / elapsed) if generated and elapsed > 0 else 0.0,
            "rollout/occupancy": busy / (steps * s1.slots) if steps else 0.0,
            "rollout/prefill_tokens": s1.prefill_tokens - s0.prefill_tokens,
            "rollout/aborted": m["aborted"],
            "rollout/resumed": m["resumed"],
            "rollout/off_policy_token_frac": float(np.mean(versions < version)) if versions.size else 0.0,
            "rollout/staleness_max": int(stale.max()),
            "rollout/staleness_mean": float(stale.mean()),
            "rollout/response_len/mean": float(lengths.mean()),
            "rollout/response_len/max": int(lengths.max()),
            "rollout/response_len/p50": float(np.median(lengths)),
            "rollout/truncated_frac": float(np.mean([s.status == "truncated" for s in samples])) if samples else 0.0,
            "rollout/dropped_tokens": m["dropped_tokens"],
            "rollout/stale_restarts": m["stale_restarts"],
            "rollout/stale_dropped_groups": m["stale_dropped_groups"],
            "rollout/evicted_groups": m["evicted_groups"],
            "rollout/buffer_groups": len(self.buffer),
            "rollout/groups": len(groups),
            "reward/mean": float(rewards.mean()),
            # groups whose rewards are all equal (no advantage signal): filtered ones with dynamic
            # sampling, otherwise the delivered ones that train on nothing
            "reward/zero_std_groups": m["zero_std_groups"] + sum(len({s.reward for s in g.samples}) == 1
                                                                 for g in groups),
            "reward/wait_s": m["reward_wait_s"],
        }

    # ---- checkpointing ----
    def state_dict(self) -> dict:
        return {"buffer": self.buffer.state_dict(), "next_group": self.next_group, "drawn": self.drawn,
                "dropped": dict(self.dropped), "length_history": dict(self.length_history), "seen": dict(self.seen),
                "step_time": list(self.step_time)}

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.next_group, self.drawn = int(state["next_group"]), int(state["drawn"])
        self.dropped = dict(state["dropped"])
        self.length_history = {k: float(v) for k, v in state["length_history"].items()}
        self.seen = {k: int(v) for k, v in state.get("seen", {"responses": 0, "tokens": 0, "ctx": 0}).items()}
        total, n = state.get("step_time", (0.0, 0))
        self.step_time = [int(total), int(n)]
