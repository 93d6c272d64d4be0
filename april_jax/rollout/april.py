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
from collections.abc import Callable, Iterator

import numpy as np

from april_jax.data.types import PromptRecord
from april_jax.rollout.buffer import PartialBuffer
from april_jax.rollout.config import RolloutConfig
from april_jax.rollout.engine import EngineProtocol, EngineStats
from april_jax.rollout.types import Group, Request, Result, Sample, SamplingParams

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
        """One training step's rollout: the delivered groups and the step's metrics."""
        step = _StepRollout(self, engine, version)
        step.drain_buffer()
        step.fill()
        while len(step.delivered) < step.target and (engine.has_unfinished() or step.scoring):
            step.pump()
            step.fill()
        step.finish_wait()
        step.terminate()
        return step.delivered, step.metrics()

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
        return Request(
            f"{key}/{s.segments}",
            s.prompt_ids + s.response_ids,
            cfg.max_response_len - len(s.response_ids),
            SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k),
            cfg.stop_token_ids,
            sample_key=key,
            shared_prefix_len=len(s.prompt_ids),
        )  # the group's members prefill their prompt once

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

    def _metrics(
        self, groups: list[Group], version: int, m: dict, engine: EngineProtocol, t0: float, s0: EngineStats
    ) -> dict:
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
            "reward/zero_std_groups": m["zero_std_groups"]
            + sum(len({s.reward for s in g.samples}) == 1 for g in groups),
            "reward/wait_s": m["reward_wait_s"],
        }

    # ---- checkpointing ----
    def state_dict(self) -> dict:
        return {
            "buffer": self.buffer.state_dict(),
            "next_group": self.next_group,
            "drawn": self.drawn,
            "dropped": dict(self.dropped),
            "length_history": dict(self.length_history),
            "seen": dict(self.seen),
            "step_time": list(self.step_time),
        }

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.next_group, self.drawn = int(state["next_group"]), int(state["drawn"])
        self.dropped = dict(state["dropped"])
        self.length_history = {k: float(v) for k, v in state["length_history"].items()}
        self.seen = {k: int(v) for k, v in state.get("seen", {"responses": 0, "tokens": 0, "ctx": 0}).items()}
        total, n = state.get("step_time", (0.0, 0))
        self.step_time = [int(total), int(n)]


class _StepRollout:
    """One `collect` call: the step's groups by where they are, its counters, and its phases (the
    module docstring's 1-3): drain the buffer, fill the engine, pump it, wait for the nearly-late
    responses to finish, terminate the rest."""

    def __init__(self, april: April, engine: EngineProtocol, version: int):
        self.april, self.engine, self.version = april, engine, version
        self.cfg, self.target = april.cfg, april.cfg.rollout_batch_size
        self.t0, self.s0 = engine.now(), engine.stats()
        self.m = dict(
            aborted=0,
            resumed=0,
            dropped_tokens=0,
            stale_restarts=0,
            stale_dropped_groups=0,
            zero_std_groups=0,
            evicted_groups=0,
            reward_wait_s=0.0,
            late_start=-1.0,
            swapped=0,
            finish_wait_s=0.0,
        )
        self.delivered: list[Group] = []
        self.surplus: list[Group] = []  # finished beyond the target: they wait in the buffer
        self.inflight: dict[str, Group] = {}
        self.scoring: dict[str, tuple[Group, object]] = {}  # finished groups whose rewards are being computed
        self.requests: dict[str, Sample] = {}
        self.weight: dict[str, float] = {}  # group id -> its share of the in-flight budget
        self.limit = april.inflight_limit(engine)

    # ---- the phases ----
    def drain_buffer(self) -> None:
        """1. The buffer first: complete groups are delivered (or scored), unfinished ones resume."""
        cfg, resumed = self.cfg, []
        for g in self.april.buffer.drain():
            if not self.april._within_staleness(g, self.version, self.m):
                continue
            if g.complete:
                self.weight[g.group_id] = 0.0
                self.accept(g) if all(s.reward is not None for s in g.samples) else self.score(g)
            else:
                self.inflight[g.group_id] = g
                unfinished = sum(not s.finished for s in g.samples)
                self.weight[g.group_id] = 1.0 if cfg.resume_count == "group" else unfinished / cfg.n_samples_per_prompt
                resumed.append(g)
        self.submit(resumed)

    def fill(self) -> None:
        """Fresh groups up to the in-flight budget."""
        self.submit(self.fresh_groups())

    def pump(self) -> None:
        """2. One engine step (finished groups go to be scored beside the engine), or, with nothing
        to generate, a wait for rewards; then the groups whose rewards are back count."""
        if self.engine.has_unfinished():
            for result in self.engine.step():
                sample = self.requests.pop(result.request_id)
                group = self.inflight[sample.group_id]
                self.april._absorb(sample, result, group.prompt)
                if group.complete:
                    del self.inflight[group.group_id]
                    self.score(group)
        else:  # nothing to generate until rewards decide what counts
            t = time.perf_counter()
            self.april._wait_any([p for _, p in self.scoring.values()])
            self.m["reward_wait_s"] += time.perf_counter() - t
        self.harvest()

    def finish_wait(self) -> None:
        """2b. (inflight=auto) before terminating, let the responses that would pass their cap at the
        next step finish (restarting one throws away its group's tokens); nothing fresh starts meanwhile."""
        april, engine = self.april, self.engine
        if not (self.cfg.waits_to_finish and april.step_time[1]):
            return
        wait_start = engine.now()
        deadline = engine.stats().decode_steps + self.cfg.finish_wait * april.step_time[0] / april.step_time[1]
        while (
            engine.has_unfinished()
            and engine.stats().decode_steps < deadline
            and any(april._at_risk(s, self.version) for s in self.requests.values())
        ):
            self.pump()
        self.m["finish_wait_s"] = engine.now() - wait_start

    def terminate(self) -> None:
        """3. Active termination: abort the rest; unfinished and surplus groups go to the buffer."""
        april, m = self.april, self.m
        for result in self.engine.abort_all():
            m["aborted"] += 1
            sample = self.requests.pop(result.request_id)
            april._absorb(sample, result, self.inflight[sample.group_id].prompt)
        t = time.perf_counter()
        self.harvest(block=True)  # finished groups beyond the target keep their rewards in the buffer
        m["reward_wait_s"] += time.perf_counter() - t
        for g in list(self.inflight.values()) + self.surplus:
            if not self.cfg.partial_rollout:
                for s in g.samples:
                    if not s.finished:
                        m["dropped_tokens"] += s.reset()
            april.buffer.put(g)
        for g in april.buffer.take_evicted():
            m["evicted_groups"] += 1
            april.dropped[g.prompt.uid] = "evicted"
            m["dropped_tokens"] += sum(len(s.response_ids) for s in g.samples)
        for g in self.delivered:
            april._remember_lengths(g)
        if self.cfg.waits_to_finish:
            steps = self.engine.stats().decode_steps - self.s0.decode_steps
            april.step_time = [april.step_time[0] + steps, april.step_time[1] + 1]

    def metrics(self) -> dict:
        m = self.m
        # the largest fraction of the step's groups delivered when a fresh group started (-1: none started)
        return {
            **self.april._metrics(self.delivered, self.version, m, self.engine, self.t0, self.s0),
            "rollout/inflight_limit": self.limit,
            "rollout/fresh_start_progress_max": m["late_start"],
            "rollout/finish_wait_s": m["finish_wait_s"],
            "rollout/swapped_groups": m["swapped"],
        }

    # ---- the pieces ----
    def submit(self, groups: list[Group]) -> None:
        batch = []
        for g in self.april._ordered(groups):
            for s in g.samples:
                if s.finished:
                    continue
                if s.response_ids:
                    self.m["resumed"] += 1
                request = self.april._request(s)
                self.requests[request.request_id] = s
                s.status, s.segments = "running", s.segments + 1
                batch.append(request)
        self.engine.submit(batch)

    def progress(self) -> float:
        """Fraction of the step's groups delivered: where in the step a start falls."""
        return len(self.delivered) / self.target

    def room(self, new_groups: int) -> bool:
        cfg, n = self.cfg, self.cfg.n_samples_per_prompt
        if len(self.requests) + (new_groups + 1) * n > self.april.inflight_limit(self.engine, self.progress()):
            return False
        if cfg.refill == "members":  # new groups are not submitted yet: count their members too
            if len(self.delivered) + len(self.scoring) >= self.target:
                return False  # enough groups finished: the step waits on rewards, not on the engine
            return len(self.requests) / n + new_groups < cfg.over_sampling_batch_size
        # A buffered group with k unfinished members counts k/n (by default): the engine keeps as
        # many requests in flight as a fresh over-sampled step would (not just 1-2 per long group).
        # Finished groups waiting for their rewards still count.
        return (
            len(self.delivered)
            + sum(self.weight[gid] for gid in self.inflight)
            + sum(self.weight[gid] for gid in self.scoring)
            < cfg.over_sampling_batch_size
        )

    def too_late(self) -> bool:
        """inflight=auto, past the cutoff: a fresh response would have too few steps before its cap;
        one still starts if the groups in flight could not meet the target without it."""
        return (
            self.cfg.inflight == "auto"
            and self.progress() >= self.cfg.late_start_cutoff
            and len(self.inflight) + len(self.scoring) >= self.target - len(self.delivered)
        )

    def fresh_groups(self) -> list[Group]:
        out = []
        while self.room(len(out)) and len(self.delivered) < self.target and not self.too_late():
            g = self.april._new_group()
            if g is None:
                break
            self.inflight[g.group_id] = g
            self.weight[g.group_id] = 1.0
            out.append(g)
            self.m["late_start"] = max(self.m["late_start"], self.progress())
        return out

    def accept(self, g: Group) -> None:
        april, cfg, delivered = self.april, self.cfg, self.delivered
        if cfg.dynamic_sampling and len({s.reward for s in g.samples}) == 1:
            self.m["zero_std_groups"] += 1
            april.dropped[g.prompt.uid] = "filtered"
        elif len(delivered) < self.target:
            delivered.append(g)
        elif cfg.inflight == "auto" and cfg.finish_wait > 0 and april._group_at_risk(g, self.version):
            # it would be past the cap at the next step: it takes the place of the freshest delivered
            # group that would not, which waits in the buffer instead (the target and cap still hold)
            fresh = [x for x in delivered if not april._group_at_risk(x, self.version)]
            if fresh:
                x = max(fresh, key=lambda x: min(april._first_version(s, self.version) for s in x.samples))
                delivered.remove(x)
                self.surplus.append(x)
                delivered.append(g)
                self.m["swapped"] += 1
            else:
                self.surplus.append(g)
        else:
            self.surplus.append(g)

    def score(self, g: Group) -> None:
        self.scoring[g.group_id] = (g, self.april._submit_scores(g))

    def harvest(self, block: bool = False) -> None:
        """Accept the groups whose rewards are back (all of them when `block`)."""
        for gid, (g, pending) in list(self.scoring.items()):
            if block or pending.done():
                for s, r in zip(g.samples, pending.result()):
                    s.reward = float(r)
                del self.scoring[gid]
                self.accept(g)
