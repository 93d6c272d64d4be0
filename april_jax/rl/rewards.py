"""Reward functions and the process pool that scores them off the rollout loop.

`reward.fn` is "math_verify", "reverse" (the tiny task, scored inline) or "module.path:function".
A custom function is imported in the trainer (a bad spec fails at start) and in each worker, and
is called in one of these forms, chosen by its signature:

    def fn(sample) -> float                      # one RewardSample (the default form)
    async def fn(sample) -> float                # a group's samples are awaited together
    @rewards.batched
    def fn(samples) -> list[float]               # a whole group at once (also `async def`)
    def fn(response_text, answer) -> float       # the old form: two required positional parameters

Every call runs in a worker process of a `pebble` pool: a call that outlives `reward.timeout_s`
(one sample, or one group for batched/async functions) has its worker killed and replaced, and
scores 0 (`reward/timeouts`); an exception or a non-finite value scores 0 (`reward/failures`).
So a stuck verifier costs one timeout, never the run, and the pool exits with the trainer.
Groups are submitted as soon as they finish and scored by `reward.workers` processes while the
engine keeps generating (`April.collect` polls for finished scores).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import difflib
import importlib
import inspect
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from april_jax.config.schema import ConfigError
from april_jax.data import reverse

# Pool workers re-run a `python -m pkg.mod` trainer's module as __mp_main__ after the fork server
# preloaded it (see RewardModel); runpy warns about exactly that, harmlessly, once per worker.
warnings.filterwarnings(
    "ignore", message=r".* found in sys.modules after import of package", category=RuntimeWarning, module="runpy"
)


@dataclasses.dataclass
class RewardSample:
    """What a reward function sees of one finished response (also readable as `sample["key"]`)."""

    prompt: Any  # the row's prompt as given: text, or a list of chat messages
    prompt_text: str  # the prompt the model saw (chat template applied)
    prompt_ids: list[int]
    response: str  # decoded response, special tokens removed
    response_ids: list[int]
    answer: str | None
    finish_reason: str | None  # "stop" or "length" (truncated at rollout.max_response_len)
    fields: dict = dataclasses.field(default_factory=dict)  # the row's other fields
    uid: str = ""  # the prompt draw's id ("epoch:index")
    index: int = 0  # the sample's index within its group

    def __getitem__(self, key: str):
        return getattr(self, key)

    def get(self, key: str, default=None):
        return getattr(self, key, default)


def batched(fn: Callable) -> Callable:
    """Mark `fn(samples: list[RewardSample]) -> list[float]` as scoring a whole group per call."""
    fn.april_batched = True
    return fn


def math_verify_reward(sample: RewardSample) -> float:
    """1.0 when math-verify finds the response's answer equal to `answer`, else 0.0.

    math-verify extracts the answer itself (boxed first, then LaTeX, then plain numbers); several
    different `\\boxed{}` answers parse as a set, so hedging scores 0. Its own `signal.alarm`
    timeouts are off: the pool's timeout bounds the call."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold = parse(f"${sample.answer}$", parsing_timeout=None)
    candidate = parse(sample.response, parsing_timeout=None)
    return 1.0 if gold and candidate and verify(gold, candidate, timeout_seconds=None) else 0.0


def reverse_reward(sample: RewardSample) -> float:
    return reverse.reward(sample.response_ids, sample.answer)


BUILTIN = {"math_verify": math_verify_reward, "reverse": reverse_reward}


def load_function(spec: str) -> Callable:
    """The function `spec` names ('math_verify', 'reverse' or 'module.path:function'), imported.
    Every way it can be wrong is a ConfigError naming reward.fn: this runs in the trainer before
    anything is built, so a typo is one line, not a traceback from a worker."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    where = f"config key 'reward.fn'={spec!r}"
    module_name, _, name = spec.partition(":")
    if not name or not module_name:
        raise ConfigError(f"{where}: expected 'math_verify', 'reverse' or 'module.path:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        why = (
            f"no module {module_name!r} (is its folder the current one, or on PYTHONPATH?)"
            if module_name == missing or module_name.startswith(missing + ".")
            else f"importing {module_name!r} failed: it imports {missing!r}, which is not installed"
        )
        raise ConfigError(f"{where}: {why}") from None
    except BaseException as e:  # the module's own code failed (a SyntaxError, an exception, even sys.exit)
        if isinstance(e, KeyboardInterrupt):
            raise
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise ConfigError(
            f"{where}: importing {module_name!r} failed ({type(e).__name__}{': ' + detail if detail else ''})"
        ) from None
    if not hasattr(module, name):
        public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
        near = difflib.get_close_matches(name, public, n=1)
        raise ConfigError(
            f"{where}: module {module_name!r} has no {name!r}"
            + (f"; did you mean {module_name + ':' + near[0]!r}?" if near else "")
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise ConfigError(f"{where}: {name!r} is a {type(fn).__name__}, not a function")
    return fn


def call_form(fn: Callable) -> str:
    """ "batched", "async", "text_answer" (the old two-argument form) or "sample"."""
    if getattr(fn, "april_batched", False):
        return "batched"
    if inspect.iscoroutinefunction(fn):
        return "async"
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return "sample"
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return "text_answer" if len(required) >= 2 else "sample"


_WORKER_FNS: dict[str, Callable] = {}


def _ready() -> None:
    """A no-op task: makes the pool start its workers."""


def _exit_with_owner(owner_pid: int) -> None:
    """Runs in a worker thread: a SIGKILLed trainer leaves its forkserver and workers behind (the
    forkserver does not notice; a worker stuck in a reward never would), so each worker polls its
    owner and, once it is gone or a zombie, takes the forkserver (its parent) down with itself."""
    server = os.getppid()
    while True:
        time.sleep(0.5)
        try:
            os.kill(owner_pid, 0)
            with open(f"/proc/{owner_pid}/stat") as f:
                alive = f.read().rpartition(")")[2].split()[0] != "Z"
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            alive = False
        if not alive:
            try:
                os.kill(server, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os._exit(1)


def _load_in_worker(spec: str, owner_pid: int | None = None) -> None:
    """Worker initializer: import the reward function (math-verify: with sympy, 2-4 s) before the
    worker takes a task, so no call's timeout pays for imports (also in a replacement worker)."""
    if owner_pid is not None:
        threading.Thread(target=_exit_with_owner, args=(owner_pid,), daemon=True).start()
    _WORKER_FNS.setdefault(spec, load_function(spec))
    if spec == "math_verify":
        import math_verify  # noqa: F401


def score_in_worker(spec: str, samples: list[RewardSample]) -> list[float]:
    """Runs in a pool worker: the rewards of `samples` (one call, or one per sample)."""
    fn = _WORKER_FNS.get(spec) or _WORKER_FNS.setdefault(spec, load_function(spec))
    form = call_form(fn)
    if form == "batched":
        out = fn(samples)
        out = asyncio.run(out) if inspect.isawaitable(out) else out
    elif form == "async":

        async def gather():
            return await asyncio.gather(*(fn(s) for s in samples))

        out = asyncio.run(gather())
    elif form == "text_answer":
        out = [fn(s.response, s.answer) for s in samples]
    else:
        out = [fn(s) for s in samples]
    out = [float(x) for x in out]
    if len(out) != len(samples):
        raise ValueError(f"reward.fn={spec!r} returned {len(out)} rewards for {len(samples)} samples")
    return out


class PendingScores:
    """The rewards of one submission, in order; `result()` blocks, turns failures into 0 and counts
    them on the model once."""

    def __init__(self, model: RewardModel, futures: list, sizes: list[int], adjust=None, samples=()):
        self.model, self.futures, self.sizes = model, futures, sizes
        self.adjust, self.samples = adjust, samples
        self._result: list[float] | None = None

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self) -> list[float]:
        if self._result is None:
            out = []
            for future, size in zip(self.futures, self.sizes):
                out += self.model._collect(future, size)
            if self.adjust is not None:
                out = [self.adjust(s, r) for s, r in zip(self.samples, out)]
            self._result = out
        return self._result


def _done_future(value) -> cf.Future:
    f = cf.Future()
    f.set_result(value)
    return f


class RewardModel:
    """Scores RewardSamples in a pool of `workers` processes, each call bounded by `timeout_s`."""

    def __init__(self, spec: str, *, timeout_s: float = 5.0, workers: int = 2):
        self.spec, self.timeout_s = spec, float(timeout_s)
        self.failures = 0
        self.timeouts = 0
        fn = load_function(spec)  # fail at start on a bad spec
        self.form = call_form(fn)
        self._pool = None
        self._inline = fn if spec == "reverse" else None  # cheap, pure: no process needed
        if self._inline is None:
            import pebble

            # forkserver: workers fork from a clean server process (the trainer is multithreaded
            # JAX, which must not be forked) that has the reward's modules imported already (when
            # this pool started it), so a killed worker is replaced in milliseconds.
            context = multiprocessing.get_context("forkserver")
            preload = ["math_verify"] if spec == "math_verify" else [spec.partition(":")[0]]
            # a `python -m pkg.mod` trainer: each worker re-runs pkg.mod as __mp_main__; with its
            # imports (JAX...) already in the server that is cheap
            main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
            if main_spec is not None and not main_spec.name.endswith("__main__"):
                preload.append(main_spec.name)
            context.set_forkserver_preload(["__main__", __name__, *preload])
            self._pool = pebble.ProcessPool(
                max_workers=workers, context=context, initializer=_load_in_worker, initargs=(spec, os.getpid())
            )
            for _ in range(workers):  # start the server and workers now, while the trainer compiles
                self._pool.schedule(_ready)

    def submit(self, samples: Sequence[RewardSample], adjust=None) -> PendingScores:
        """Start scoring; per-sample functions get one task per sample (parallel across workers),
        batched and async ones one task for the whole list."""
        samples = list(samples)
        if self._inline is not None:
            futures, sizes = [_done_future([self._safe_inline(s) for s in samples])], [len(samples)]
        elif self.form in ("batched", "async"):
            futures, sizes = (
                [self._pool.schedule(score_in_worker, (self.spec, samples), timeout=self.timeout_s)],
                [len(samples)],
            )
        else:
            futures = [self._pool.schedule(score_in_worker, (self.spec, [s]), timeout=self.timeout_s) for s in samples]
            sizes = [1] * len(samples)
        return PendingScores(self, futures, sizes, adjust, samples)

    def score_many(self, samples: Sequence[RewardSample]) -> list[float]:
        return self.submit(samples).result()

    def score(self, sample: RewardSample) -> float:
        return self.score_many([sample])[0]

    def _safe_inline(self, sample: RewardSample) -> float:
        try:
            return self._finite(float(self._inline(sample)))
        except Exception:  # a judge failure must not stop training; it is counted
            self.failures += 1
            return 0.0

    def _finite(self, value: float) -> float:
        if math.isfinite(value):
            return value
        self.failures += 1
        return 0.0

    def _collect(self, future, size: int) -> list[float]:
        try:
            values = future.result()
        except cf.TimeoutError:  # pebble killed the stuck worker and started a new one
            self.timeouts += size
            return [0.0] * size
        except Exception:  # the function raised, or its worker died
            self.failures += size
            return [0.0] * size
        if self._inline is not None:
            return values  # already checked
        return [self._finite(v) for v in values]

    def close(self) -> None:
        """Stop the workers (a stuck one is killed) and wait for them: no hang at exit."""
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None


class GroupScorer:
    """APRIL's side of a RewardModel: turns a finished group into RewardSamples and submits them.

    `decode` gives response text (special tokens dropped), `decode_prompt` the prompt text as the
    model saw it; `adjust(sample, reward) -> reward` runs on the scores (the overlong penalty)."""

    def __init__(self, model: RewardModel, decode: Callable, decode_prompt: Callable | None = None, adjust=None):
        self.model, self.decode, self.adjust = model, decode, adjust
        self.decode_prompt = decode_prompt or decode

    def sample(
        self, prompt, response_ids, finish_reason, index: int = 0, prompt_text: str | None = None
    ) -> RewardSample:
        prompt_text = self.decode_prompt(prompt.prompt_ids) if prompt_text is None else prompt_text
        return RewardSample(
            prompt=prompt.prompt if prompt.prompt is not None else prompt_text,
            prompt_text=prompt_text,
            prompt_ids=list(prompt.prompt_ids),
            response=self.decode(response_ids),
            response_ids=list(response_ids),
            answer=prompt.answer,
            finish_reason=finish_reason,
            fields=dict(prompt.fields),
            uid=prompt.uid,
            index=index,
        )

    def submit_group(self, group) -> PendingScores:
        prompt_text = self.decode_prompt(group.prompt.prompt_ids)  # once: the members share it
        samples = [
            self.sample(group.prompt, s.response_ids, s.finish_reason, s.index, prompt_text) for s in group.samples
        ]
        return self.model.submit(samples, self.adjust)
