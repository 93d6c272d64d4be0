"""Reward functions and the process pool that scores them off the rollout loop.

`reward.fn` is "math_verify", "reverse" (the tiny task, scored inline) or "module.path:function".
A custom function is imported in the trainer (a bad spec fails at start) and in each worker, and
is called in one of these forms, chosen by its signature:

    def fn(sample) -> float                      # one RewardSample (the default form)
    async def fn(sample) -> float                # a group's samples are awaited together
    @rewards.batched
    def fn(samples) -> list[float]               # a whole group at once (also `async def`)
    def fn(response_text, answer) -> float       # the old form: two required positional parameters

Every call runs in a worker process of a `pebble` pool, isolated from the trainer: whatever the
function raises (BaseException included: KeyboardInterrupt, SystemExit...), a value that is no
finite number, a batch of the wrong length, or a worker that exits or is killed mid-call scores 0
and is counted (`reward/failures`); a call that outlives `reward.timeout_s` (one sample, or one
group for batched/async functions) has its worker killed and replaced and scores 0
(`reward/timeouts`). Each failure keeps its sample, function and exception (`FailureLog`: the
training loop writes them to WORKDIR/reward_failures.jsonl). So a broken or stuck verifier costs
a score, never the run.

What a reward function starts (a sandbox, a judge server) goes with its worker: each worker is a
session of its own, carries the pool's token in its environment (which every exec'd descendant
inherits) and registers itself, so that closing the pool finds and kills the workers' whole
process trees, also the processes that left their parent or their session (`_tree`), and a worker
that exits takes what it started along. A trainer killed with SIGKILL: its workers notice (the
pool's pipe closes, and they poll the trainer) and take every tree of the pool down themselves;
only a worker stuck in C code that holds the GIL cannot.

Groups are submitted as soon as they finish and scored by `reward.workers` processes while the
engine keeps generating (`April.collect` polls for finished scores).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures as cf
import contextlib
import dataclasses
import difflib
import importlib
import inspect
import math
import multiprocessing
import multiprocessing.util
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from april_jax.config.schema import ConfigError
from april_jax.data import reverse
from april_jax.rl.failed_rewards import FailureLog
from april_jax.runtime.processes import terminate

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


# ---- the workers' process trees ----
TREE_ENV = "APRIL_JAX_REWARD_TREE"  # a pool's token, in the environment of what its workers start


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, session, start ticks) of a process; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces
    return fields[0], int(fields[1]), int(fields[3]), int(fields[19])


def _live() -> dict[int, tuple[str, int, int, int]]:
    """Every live process (zombies are dead: only their parent's wait is missing)."""
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc (not Linux): nothing can be found, nothing is killed
        return {}
    return {int(n): s for n in names if n.isdigit() and (s := _stat(int(n))) is not None and s[0] != "Z"}


def _carries(pid: int, token: str) -> bool:
    """Whether the process was started with TREE_ENV=token (/proc keeps a process's starting
    environment: exec'd descendants of a worker have it, whatever parent or session they have now)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:  # gone, or another user's: not ours
        return False
    return f"{TREE_ENV}={token}".encode() in environ.split(b"\0")


def _registered(registry: str | None) -> dict[int, int]:
    """Worker pid -> start ticks, of every worker the pool ever started (the worker's pid is its
    session's id: a forked child that never exec'd carries no token but stays in the session)."""
    out = {}
    try:
        names = os.listdir(registry) if registry else []
    except OSError:
        return out
    for name in names:
        pid, _, start = name.partition("-")
        if pid.isdigit() and start.isdigit():
            out[int(pid)] = int(start)
    return out


def _tree(token: str, registry: str | None) -> list[int]:
    """The live processes of a pool's trees: its workers' sessions, the processes that carry its
    token, and whatever descends from either. A session counts while its leader is the registered
    worker or is gone: the kernel gives no new process the id of a session that still has members,
    so only a leader alive with another start time is someone else's."""
    live, sessions = _live(), _registered(registry)
    found = {
        pid
        for pid, (_, _, sid, _) in live.items()
        if (sid in sessions and (sid not in live or live[sid][3] == sessions[sid])) or _carries(pid, token)
    }
    grew = True
    while grew:
        kids = {pid for pid, s in live.items() if s[1] in found and pid not in found}
        found |= kids
        grew = bool(kids)
    return sorted(found - {os.getpid()})


def _descendants(root: int) -> list[int]:
    """The live processes below `root` (by parent), and those of its session when it leads one."""
    live = _live()
    found = {pid for pid, s in live.items() if s[2] == root and pid != root}
    frontier = {root} | found
    while frontier:
        frontier = {pid for pid, s in live.items() if s[1] in frontier and pid not in found and pid != root}
        found |= frontier
    return sorted(found)


def _kill(find: Callable[[], list[int]], grace: float) -> list[int]:
    """`terminate` with the workers' short settle (5 s) and quick rounds: a pool is small."""
    return terminate(find, grace, settle=5.0, poll=0.02)


def _reap(token: str, registry: str | None, grace: float = 1.0) -> list[int]:
    """Kill every process of a pool's trees (see `_tree`) but the caller; the pids signalled."""
    return _kill(lambda: _tree(token, registry), grace)


def _start_ticks(pid: int) -> int:
    return (_stat(pid) or ("", 0, 0, 0))[3]


def _alive(pid: int) -> bool:
    """Running (a zombie's work is over); without /proc, whether the pid exists."""
    stat = _stat(pid)
    if stat is None and not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return stat is not None and stat[0] != "Z"


# ---- the worker side ----
_WORKER_FNS: dict[str, Callable] = {}
_WORKER: dict[str, Any] = {}  # this worker's owner pid, token, registry; a failed import


def _ready() -> None:
    """A no-op task: makes the pool start its workers."""


def _exit_with_owner(owner_pid: int, token: str, registry: str | None) -> None:
    """Runs in a worker thread: a SIGKILLed trainer may leave its forkserver and workers behind (a
    worker stuck in a reward never notices), so each worker polls its owner and, once it is gone or
    a zombie, takes down every tree of the pool, the forkserver (its parent), and itself."""
    server = os.getppid()
    while _alive(owner_pid):
        time.sleep(0.5)
    _orphaned(token, registry)
    try:
        os.kill(server, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os._exit(1)


def _orphaned(token: str, registry: str | None) -> None:
    """The trainer is gone: nobody else will stop the pool's trees (every worker may do this at
    once; a process killed twice is no harm)."""
    _reap(token, registry, grace=0.5)
    if registry:
        shutil.rmtree(registry, ignore_errors=True)


def _leave() -> None:
    """Runs as a worker exits, however it does (its pipe closed, a SIGTERM from pebble): what its
    reward calls started goes with it, and the whole pool's trees when the trainer is gone (its
    pipe closes then: an idle worker exits before its poll of the owner would notice)."""
    if _WORKER.pop("leaving", None) is None:
        return  # done already (a SIGTERM handler, then the exit's finalizers)
    owner = _WORKER.get("owner")
    if owner is not None and not _alive(owner):
        _orphaned(_WORKER["token"], _WORKER["registry"])
    else:
        me = os.getpid()
        _kill(lambda: _descendants(me), grace=0.5)


def _on_sigterm(signum, frame) -> None:
    _leave()
    previous = _WORKER.get("sigterm")
    if callable(previous):
        previous(signum, frame)  # pebble's: multiprocessing's exit, then os._exit
    os._exit(128 + signum)


def _load_in_worker(spec: str, owner_pid: int | None = None, token: str = "", registry: str | None = None) -> None:
    """Worker initializer: a session of its own, the pool's token and registration (see `_tree`),
    then import the reward function (math-verify: with sympy, 2-4 s) before the worker takes a
    task, so no call's timeout pays for imports (also in a replacement worker). It never raises:
    pebble would restart a worker whose initializer fails, forever; the import error is each
    call's failure instead."""
    _WORKER.update(owner=owner_pid, token=token, registry=registry, sigterm=signal.getsignal(signal.SIGTERM))
    if token:
        with contextlib.suppress(OSError):
            os.setsid()  # what the reward forks stays in this session, also after this worker died
        os.environ[TREE_ENV] = token  # every subprocess the reward starts inherits it
        if registry:
            with contextlib.suppress(OSError):
                open(os.path.join(registry, f"{os.getpid()}-{_start_ticks(os.getpid())}"), "w").close()
        # multiprocessing runs its finalizers as a worker exits (not in a forked child: pid check)
        _WORKER["leaving"] = multiprocessing.util.Finalize(None, _leave, exitpriority=100)
        signal.signal(signal.SIGTERM, _on_sigterm)
    if owner_pid is not None:
        threading.Thread(target=_exit_with_owner, args=(owner_pid, token, registry), daemon=True).start()
    try:
        _WORKER_FNS.setdefault(spec, load_function(spec))
        if spec == "math_verify":
            import math_verify  # noqa: F401
    except BaseException as e:  # a module that exits or raises in the worker only
        _WORKER["load_error"] = _failure(e, f"importing reward.fn={spec!r} in the worker failed: ")


# A failed score: (exception type, message). Plain tuples: they cross the pool's pipe as they are.
Failure = tuple[str, str]


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failure(e: BaseException, prefix: str = "") -> Failure:
    try:
        message = f"sys.exit({e.code!r})" if isinstance(e, SystemExit) else str(e)
    except BaseException:  # an exception whose __str__ fails is still a failure
        message = "<unprintable>"
    return type(e).__name__, _one_line(prefix + message)


def _number(value) -> float | Failure:
    """A reward function's value as a finite float, or why it is not one."""
    if value is None:  # a function that forgot its `return`
        return "TypeError", "reward returned None, not a number"
    try:
        number = float(value)
    except BaseException:  # a value whose __float__ raises anything
        return "TypeError", f"reward returned {_one_line(repr(value), 60)} ({type(value).__name__}), not a number"
    if not math.isfinite(number):
        return "ValueError", f"reward returned {number}, not a finite number"
    return number


def _call(fn: Callable, *args) -> float | Failure:
    try:
        return _number(fn(*args))
    except BaseException as e:  # SystemExit or KeyboardInterrupt too: this process is the reward's
        return _failure(e)


def score_in_worker(spec: str, samples: list[RewardSample]) -> list[float | Failure]:
    """Runs in a pool worker: the rewards of `samples` (one call, or one per sample), each a float
    or a Failure. It never raises: pebble would carry a BaseException into the trainer and raise
    it there (a KeyboardInterrupt, a SystemExit(7): the trainer's own exit)."""
    n = len(samples)
    try:
        if "load_error" in _WORKER:
            return [_WORKER["load_error"]] * n
        fn = _WORKER_FNS.get(spec) or _WORKER_FNS.setdefault(spec, load_function(spec))
        form = call_form(fn)
        if form == "batched":
            out = fn(samples)
            out = asyncio.run(out) if inspect.isawaitable(out) else out
            try:
                out = list(out)
            except TypeError:
                return [("TypeError", f"batched reward returned {type(out).__name__}, not a list of numbers")] * n
            if len(out) != n:
                got = f"{len(out)} score" + "s" * (len(out) != 1)
                return [("ValueError", f"batched reward returned {got} for {n} samples")] * n
            return [_number(x) for x in out]
        if form == "async":

            async def gather():
                return await asyncio.gather(*(fn(s) for s in samples), return_exceptions=True)

            return [_failure(x) if isinstance(x, BaseException) else _number(x) for x in asyncio.run(gather())]
        if form == "text_answer":
            return [_call(fn, s.response, s.answer) for s in samples]
        return [_call(fn, s) for s in samples]
    except BaseException as e:  # see above
        return [_failure(e)] * n


# ---- the trainer side ----
class PendingScores:
    """The rewards of one submission, in order; `result()` blocks, turns failures into 0 and counts
    them on the model once."""

    def __init__(self, model: RewardModel, futures: list, chunks: list[list[RewardSample]], adjust=None, samples=()):
        self.model, self.futures, self.chunks = model, futures, chunks
        self.adjust, self.samples = adjust, samples
        self._result: list[float] | None = None

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self) -> list[float]:
        if self._result is None:
            out = []
            for future, chunk in zip(self.futures, self.chunks):
                out += self.model._collect(future, chunk)
            if self.adjust is not None:
                out = [self.adjust(s, r) for s, r in zip(self.samples, out)]
            self._result = out
        return self._result


def _done_future(value) -> cf.Future:
    f = cf.Future()
    f.set_result(value)
    return f


def _pool_failure(e: BaseException) -> Failure:
    """A future's exception (the worker side never raises) as a Failure: the worker died."""
    code = getattr(e, "exitcode", None)
    if type(e).__name__ == "ProcessExpired" and code is not None:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else None
        return "WorkerDied", f"the reward worker {how or f'exited with code {code}'} while scoring"
    if type(e).__name__ == "BrokenProcessPool":
        return "WorkerDied", "a reward worker died while no call was running; the pool was restarted"
    return _failure(e)


class RewardModel:
    """Scores RewardSamples in a pool of `workers` processes, each call bounded by `timeout_s`."""

    def __init__(self, spec: str, *, timeout_s: float = 5.0, workers: int = 2):
        self.spec, self.timeout_s, self.workers = spec, float(timeout_s), workers
        self.failures = 0
        self.timeouts = 0
        self.failure_log = FailureLog()
        fn = load_function(spec)  # fail at start on a bad spec
        self.form = call_form(fn)
        self._pool = None
        self._token, self._registry = "", None
        self._inline = fn if spec == "reverse" else None  # cheap, pure: no process needed
        if self._inline is None:
            # begins with the trainer's pid and start: whose a process found later is, at a glance
            self._token = f"{os.getpid()}-{_start_ticks(os.getpid())}-{secrets.token_hex(6)}"
            self._registry = tempfile.mkdtemp(prefix="april_jax_reward_workers_")
            self._start_pool()
            atexit.register(self.close)  # a trainer that ends before its cleanup closes the pool

    def _start_pool(self) -> None:
        import pebble

        # forkserver: workers fork from a clean server process (the trainer is multithreaded
        # JAX, which must not be forked) that has the reward's modules imported already (when
        # this pool started it), so a killed worker is replaced in milliseconds.
        context = multiprocessing.get_context("forkserver")
        preload = ["math_verify"] if self.spec == "math_verify" else [self.spec.partition(":")[0]]
        # a `python -m pkg.mod` trainer: each worker re-runs pkg.mod as __mp_main__; with its
        # imports (JAX...) already in the server that is cheap
        main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if main_spec is not None and not main_spec.name.endswith("__main__"):
            preload.append(main_spec.name)
        context.set_forkserver_preload(["__main__", __name__, *preload])
        self._pool = pebble.ProcessPool(
            max_workers=self.workers,
            context=context,
            initializer=_load_in_worker,
            initargs=(self.spec, os.getpid(), self._token, self._registry),
        )
        for _ in range(self.workers):  # start the server and workers now, while the trainer compiles
            self._pool.schedule(_ready)

    def _schedule(self, samples: list[RewardSample]):
        if not self._pool.active:  # a worker that died between calls breaks a pebble pool for good
            self._stop_pool()
            self._start_pool()
        return self._pool.schedule(score_in_worker, (self.spec, samples), timeout=self.timeout_s)

    def submit(self, samples: Sequence[RewardSample], adjust=None) -> PendingScores:
        """Start scoring; per-sample functions get one task per sample (parallel across workers),
        batched and async ones one task for the whole list."""
        samples = list(samples)
        if self._inline is not None:
            chunks = [samples]
            futures = [_done_future([self._safe_inline(s) for s in samples])]
        elif self.form in ("batched", "async"):
            chunks = [samples]
            futures = [self._schedule(samples)]
        else:
            chunks = [[s] for s in samples]
            futures = [self._schedule(chunk) for chunk in chunks]
        return PendingScores(self, futures, chunks, adjust, samples)

    def score_many(self, samples: Sequence[RewardSample]) -> list[float]:
        return self.submit(samples).result()

    def score(self, sample: RewardSample) -> float:
        return self.score_many([sample])[0]

    def _safe_inline(self, sample: RewardSample) -> float | Failure:
        try:
            return _number(self._inline(sample))
        except Exception as e:  # a judge failure must not stop training; it is counted
            return _failure(e)

    def _collect(self, future, chunk: list[RewardSample]) -> list[float]:
        try:
            outcomes = future.result()
        except cf.TimeoutError:  # pebble killed the stuck worker and started a new one
            self.timeouts += len(chunk)
            for s in chunk:
                self._record(s, ("TimeoutError", f"no reward within reward.timeout_s={self.timeout_s:g} s"))
            return [0.0] * len(chunk)
        except BaseException as e:  # a worker that died, a pool that broke
            if not isinstance(e, Exception) and getattr(e, "traceback", None) is None:
                raise  # raised here, not carried from a worker: the trainer's own interrupt
            outcomes = [_pool_failure(e)] * len(chunk)
        if not isinstance(outcomes, list) or len(outcomes) != len(chunk):
            outcomes = [("WorkerDied", f"the reward worker answered {type(outcomes).__name__}")] * len(chunk)
        values = []
        for s, outcome in zip(chunk, outcomes):
            if isinstance(outcome, tuple):
                self.failures += 1
                self._record(s, outcome)
                outcome = 0.0
            values.append(outcome)
        return values

    def _record(self, sample: RewardSample, failure: Failure) -> None:
        where = f"{sample.uid}#{sample.index}" if sample.uid else f"#{sample.index}"
        self.failure_log.add(self.spec, where, *failure)

    def _stop_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            with contextlib.suppress(cf.TimeoutError, TimeoutError, RuntimeError):
                pool.join(timeout=10)

    def close(self) -> None:
        """Stop the workers (a stuck one is killed) and wait for them, then kill whatever they
        started that is still running: no hang at exit, nothing left behind."""
        self._stop_pool()
        if self._token:
            _reap(self._token, self._registry)
            shutil.rmtree(self._registry, ignore_errors=True)
            self._token = ""
            atexit.unregister(self.close)


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
