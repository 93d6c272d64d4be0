"""python -m april_jax.train --config configs/tiny.py [--config.a.b=value ...]

One loop: APRIL rollout -> rewards -> advantages -> sharded policy update -> weights to the
engine -> metrics -> checkpoint. Restarting with the same workdir resumes from the latest
checkpoint (params, optimiser state, step, version, RNG, data position, APRIL partial buffer).

SIGTERM / SIGINT (preemption, Ctrl-C): the step in progress is abandoned if its rollout is not
done yet (else it finishes), a checkpoint of the last finished step is written (unless one
exists), the engine and the reward workers are stopped, one line says where the checkpoint is,
and the exit code is 128 + the signal (143 / 130: a scheduler then retries the job, and rerunning
the same command resumes as if nothing had happened).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from april_jax import config as config_lib
from april_jax import distributed
from april_jax.config import ConfigError, fail
from april_jax.errors import Stopped
from april_jax.rollout.engine import EngineProtocol
from april_jax.task import Task, build_task


def _check_config_file(argv: list[str]) -> str:
    """The --config FILE, checked to exist and to parse (absl's own errors do not name it)."""
    file = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    file = file or next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if not file:
        raise ConfigError("missing --config FILE (e.g. --config configs/tiny.py; --help lists every key)")
    path = Path(file.split(":", 1)[0] if not Path(file).exists() else file)  # FILE:arg selects a variant
    if not path.is_file():
        raise ConfigError(f"config file {file}: not found")
    try:
        compile(path.read_bytes(), str(path), "exec")
    except SyntaxError as e:
        raise ConfigError(f"config file {path}:{e.lineno}: syntax error ({e.msg})") from None
    except ValueError as e:  # null bytes and the like
        raise ConfigError(f"config file {path}: {e}") from None
    return str(path)


def load_config(argv: list[str]):
    """Parse --config FILE and --config.* overrides with ml_collections config_flags."""
    from absl import flags
    from ml_collections import config_flags

    config_lib.check_overrides(argv)
    file = _check_config_file(argv)
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "training config file", flag_values=fv, lock_config=True,
                                    sys_argv=argv)
    try:
        fv(argv)
    except SystemExit as e:  # get_config() called sys.exit: nothing to train, but not a success either
        raise ConfigError(f"config file {file}: get_config() called sys.exit({e.code!r}) instead of returning "
                          f"a config") from None
    except (flags.Error, KeyError, TypeError, ValueError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    except Exception as e:  # the config file's own code failed (get_config raised): name the file
        raise ConfigError(f"config file {file}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    from ml_collections import ConfigDict

    if not isinstance(fv.config, ConfigDict):
        raise ConfigError(f"config file {file}: get_config() returned {type(fv.config).__name__}, not a config "
                          f"(return april_jax.config.default_config() with your changes)")
    c = config_lib.validate(fv.config)
    from april_jax import assets

    with c.unlocked():
        c.model.path = assets.resolve(c.model.path)
        c.data.train_path = assets.resolve(c.data.train_path)
        c.data.eval_path = assets.resolve(c.data.eval_path)
        c.data.tokenizer_path = assets.resolve(c.data.tokenizer_path)
        c.loss.ref_path = assets.resolve(c.loss.ref_path)
    return c


def build_model(c, mesh, vocab_size):
    from april_jax.models import hf, qwen3

    dtype = qwen3.as_dtype(c.model.dtype)
    compute = qwen3.as_dtype(c.model.compute_dtype)
    choices = dict(remat=c.model.remat, attention_impl=c.model.attention_impl)
    if c.model.path:
        return hf.from_pretrained(c.model.path, dtype=dtype, compute_dtype=compute, mesh=mesh, **choices)
    if c.model.arch == "tiny":
        cfg = qwen3.Qwen3Config(vocab_size=vocab_size or 1024, param_dtype=dtype, dtype=compute,
                                max_position_embeddings=4096, **choices, **c.model.tiny.to_dict())
    elif c.model.arch in qwen3.PRESETS:
        cfg = qwen3.PRESETS[c.model.arch].replace(param_dtype=dtype, dtype=compute, **choices)
    else:
        raise ConfigError(f"config key 'model.arch'={c.model.arch!r}: expected 'tiny' or one of {sorted(qwen3.PRESETS)}")
    return qwen3.init_model(cfg, seed=c.seed, mesh=mesh)


def build_reference(c, mesh, model, workdir: Path, fresh: bool):
    """The frozen KL reference, or None (no KL, or the Trainer copies the initial params).

    loss.ref_path if set; else the initial policy. After a supervised warm-up the initial policy
    cannot be rebuilt from the config on resume, so a fresh run saves it to WORKDIR/reference.
    """
    from april_jax.models import hf, qwen3

    if not c.loss.kl_coef:
        return None
    path = c.loss.ref_path
    if not path and c.warmup.steps:
        path = str(workdir / "reference")
        if fresh:
            distributed.save_pretrained(model, path)
            return None
    if not path:
        return None
    return hf.from_pretrained(path, dtype=qwen3.as_dtype(c.model.dtype), mesh=mesh,
                                 compute_dtype=qwen3.as_dtype(c.model.compute_dtype), remat=c.model.remat,
                                 attention_impl=c.model.attention_impl)


def build_engine(c, model, max_model_len: int, version: int) -> EngineProtocol:
    if c.rollout.engine == "jax":
        from april_jax.rollout.jax_engine import JaxEngine

        return JaxEngine(model, max_num_seqs=c.rollout.max_num_seqs, max_model_len=max_model_len, seed=c.seed,
                         policy_version=version, decode_steps_per_call=c.rollout.decode_steps_per_call,
                         reuse_aborted_kv=c.rollout.reuse_aborted_kv, samples_per_prompt=c.rollout.n_samples_per_prompt,
                         free_kv_in_sleep=c.rollout.free_kv_cache_in_train,
                         merge_padding_tokens=c.rollout.merge_padding_tokens,
                         hold_aborted_kv=c.rollout.hold_aborted_kv,
                         smallest_prefill_bucket=c.rollout.smallest_prefill_bucket)
    if c.rollout.engine == "sim":
        from april_jax.rollout.sim_engine import SimEngine

        return SimEngine(slots=c.rollout.max_num_seqs, seed=c.seed, max_model_len=max_model_len,
                         length_scale=c.rollout.max_response_len / 32768, policy_version=version)
    from april_jax.rollout.vllm.engine import VllmEngine
    from april_jax.rollout.vllm.server import VllmSetupError, find_vllm_python, prepare_model_dir

    urls = [u.strip() for u in c.rollout.vllm_urls.split(",") if u.strip()]
    try:
        if urls:
            return VllmEngine(urls=urls, api_key=os.environ.get("VLLM_API_KEY"), max_num_seqs=c.rollout.max_num_seqs,
                              max_model_len=max_model_len, policy_version=version,
                              weight_transport=c.rollout.weight_transport, sleep_mode=c.rollout.vllm_sleep_mode)
        python = find_vllm_python(c.rollout.vllm_python or None)
    except VllmSetupError as e:
        raise ConfigError(f"rollout.vllm_urls: {e}" if urls else str(e)) from None
    # the server starts from the trainer's current weights, with the run's tokenizer
    init_dir = prepare_model_dir(model, Path(c.workdir) / "vllm_init", c.data.tokenizer_path or c.model.path or None)
    return VllmEngine(init_dir, python=python, max_num_seqs=c.rollout.max_num_seqs,
                      max_model_len=max_model_len, policy_version=version, log_dir=c.workdir,
                      dtype=c.model.compute_dtype, weight_transport=c.rollout.weight_transport,
                      sleep_mode=c.rollout.vllm_sleep_mode)


def evaluate(engine, prompts, scorer, c, stop_ids, version: int) -> dict:
    """avg@k: mean reward over k samples per held-out prompt; pass@1-style accuracy = reward == 1."""
    from april_jax.rollout.types import Request, SamplingParams

    if not prompts:
        return {}
    reqs = [Request(f"eval/{i}/{k}", p.prompt_ids, c.rollout.max_response_len,
                    SamplingParams(c.eval.temperature, seed=1000 * i + k), stop_ids)
            for i, p in enumerate(prompts) for k in range(c.eval.n_samples)]
    out = engine.generate(reqs)
    samples = [scorer.sample(prompts[int(r.request_id.split("/")[1])], out[r.request_id].token_ids,
                             out[r.request_id].finish_reason, int(r.request_id.split("/")[2])) for r in reqs]
    scores = np.array(scorer.model.score_many(samples))
    return {f"eval/avg@{c.eval.n_samples}": float(scores.mean()), "eval/accuracy": float(np.mean(scores >= 1.0)),
            "eval/response_len": float(np.mean([len(out[r.request_id].token_ids) for r in reqs])),
            "eval/version": version}


class TrainingError(RuntimeError):
    """The run cannot go on (it diverged, or every reward failed); the message says why and what was kept."""


def check_vocab(c, task_vocab: int | None) -> None:
    """Token ids past the model's embedding would be clamped silently: compare the sizes up front."""
    from april_jax.models import hf, qwen3

    if task_vocab is None or (not c.model.path and c.model.arch == "tiny"):
        return  # the tiny model is sized to the task's vocabulary
    if c.model.path:
        from april_jax.models.hf import read_config

        model_vocab, what = read_config(c.model.path).get("vocab_size"), f"model.path={c.model.path}"
    elif c.model.arch in qwen3.PRESETS:
        model_vocab, what = qwen3.PRESETS[c.model.arch].vocab_size, f"model.arch={c.model.arch}"
    else:
        return  # build_model names the bad arch
    if model_vocab is not None and task_vocab > int(model_vocab):
        source = c.data.tokenizer_path or c.model.path or "the task"
        raise ConfigError(f"the tokenizer ({source}) has {task_vocab} tokens but the model ({what}) only "
                          f"{model_vocab}: set data.tokenizer_path to the model's tokenizer")


def run(c, stop: distributed.StopSignal | None = None) -> dict:
    from april_jax import compile_cache
    from april_jax.workdir_lock import WorkdirLock, check_workdir

    started = time.perf_counter()
    stop = stop or distributed.StopSignal()
    workdir = check_workdir(c.workdir)  # before anything is loaded
    cache = compile_cache.enable(c.train.compile_cache_dir)  # before the first compile
    if cache:
        print(f"XLA compilation cache: {cache} (--config.train.compile_cache_dir= turns it off)", file=sys.stderr)
    distributed.initialize()  # several processes: the mesh then spans every process's devices
    lock = WorkdirLock(workdir) if distributed.is_main() else None  # processes share one workdir
    if lock is not None and workdir.exists():
        lock.acquire()  # a second trainer stops here, before loading anything
    try:
        return _run(c, workdir, lock, started, stop)
    finally:
        if lock is not None:
            lock.release()


def _run(c, workdir: Path, lock, started: float, stop) -> dict:
    from april_jax.models import sharding

    mesh = sharding.make_mesh(c.mesh.to_dict())
    # Everything that can reject bad input runs before the workdir is touched.
    task = build_task(c, c.model.path or None)
    with contextlib.ExitStack() as cleanup:  # closes what was opened, in reverse, however the run ends
        cleanup.callback(task.reward.close)
        return _train(c, workdir, lock, mesh, task, cleanup, started, stop)


class _MarkFailedRewards:
    """Wraps a GroupScorer: a group whose every reward failed (an exception, NaN or a timeout: the
    model counts them) has its samples marked, so that a step of such groups trains nothing. The
    mark travels with buffered groups (delivered, or checkpointed, in a later step)."""

    def __init__(self, scorer, reward):
        self.scorer, self.reward = scorer, reward

    def submit_group(self, group):
        return _MarkedScores(self.scorer.submit_group(group), group, self.reward)


class _MarkedScores:
    def __init__(self, pending, group, reward):
        self.pending, self.group, self.reward, self._result = pending, group, reward, None

    def done(self) -> bool:
        return self.pending.done()

    def __getattr__(self, name):  # futures and whatever else APRIL reads from a PendingScores
        return getattr(self.pending, name)

    def result(self) -> list[float]:
        if self._result is None:
            before = self.reward.failures + self.reward.timeouts
            self._result = self.pending.result()
            failed = self.reward.failures + self.reward.timeouts - before >= len(self.group.samples)
            for s in self.group.samples:
                s.metadata["reward_failed"] = failed
        return self._result


def _train(c, workdir: Path, lock, mesh, task: Task, cleanup, started: float, stop) -> dict:
    import jax

    from april_jax import compile_clock
    from april_jax.checkpointing import Checkpointer, frozen_copy
    from april_jax.metrics import MetricsWriter, truncate_log
    from april_jax.rl.advantages import overlong_penalty
    from april_jax.rl.batch import groups_to_batch
    from april_jax.rl.rewards import GroupScorer
    from april_jax.rl.train_step import Trainer
    from april_jax.rollout.april import April

    train_prompts, eval_prompts, stop_ids, reward = task.train, task.eval_prompts, task.stop_ids, task.reward
    check_vocab(c, task.vocab_size)
    mesh = mesh if jax.device_count() > 1 else None
    model = build_model(c, mesh, task.vocab_size)
    if lock is not None:
        lock.acquire()
    workdir.mkdir(parents=True, exist_ok=True)
    main = distributed.is_main()  # process 0 owns the rollout and the workdir's files (distributed.py)
    max_model_len = c.rollout.max_model_len or (c.data.max_prompt_len + c.rollout.max_response_len)
    ckpt = Checkpointer(workdir / "checkpoints", keep=c.checkpoint.keep)
    cleanup.callback(ckpt.close)
    latest = ckpt.latest_step()
    ckpt.check_resumable(json.loads(c.to_json()), model.cfg.to_hf_config())
    if main:
        (workdir / "config.json").write_text(c.to_json(indent=2))
    warmed_up = latest is None and bool(c.warmup.steps)
    if warmed_up:  # fresh run: supervised warm-up before RL on the task's examples
        from april_jax.rl import sft

        examples = task.warmup_examples(c.seed, 20_000)
        losses = sft.warmup(model, examples, steps=c.warmup.steps, lr=c.warmup.lr, batch_size=c.warmup.batch_size,
                            seed=c.seed)
        print(f"supervised warm-up: {c.warmup.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}", file=sys.stderr)
    trainer = Trainer(model, config_lib.loss_cfg(c), config_lib.optimizer_cfg(c), mesh=mesh,
                      micro_batch_size=c.train.micro_batch_size or None, temperature=c.rollout.temperature or 1.0,
                      reference=build_reference(c, mesh, model, workdir, fresh=latest is None))

    def overlong(sample, r):
        return r + float(overlong_penalty(len(sample.response_ids), c.rollout.max_response_len,
                                          c.reward.overlong_buffer, c.reward.overlong_factor))

    scorer = GroupScorer(reward, task.decode, task.decode_prompt, overlong if c.reward.overlong_buffer else None)
    eval_scorer = GroupScorer(reward, task.decode, task.decode_prompt)
    april = April(config_lib.rollout_cfg(c, stop_ids), train_prompts, _MarkFailedRewards(scorer, reward))
    start, version, rng = 0, 0, {}
    restored = ckpt.restore_latest(trainer.params, trainer.opt_state, trainer.param_shardings, trainer.opt_shardings,
                                   log=lambda line: print(line, file=sys.stderr))
    if restored is not None:
        latest, trainer.params, trainer.opt_state, meta = restored
        trainer.skipped_steps = meta["skipped_steps"]
        start, version, rng = meta["step"], meta["version"], meta.get("rng", {})
        train_prompts.load_state_dict(meta["data"])
        april.load_state_dict(meta["april"])
        reward.failures = int(rng.get("reward_failures", 0))
        reward.timeouts = int(rng.get("reward_timeouts", 0))
        print(f"resumed from {ckpt.directory / str(latest)} (step {start}, version {version}, "
              f"{len(april.buffer)} buffered groups)", file=sys.stderr)
    for name in ("metrics.jsonl", "delivered.jsonl"):
        if main:
            truncate_log(workdir / name, start)

    writer = engine = None
    if main:
        writer = MetricsWriter(workdir, tensorboard=c.log.tensorboard, progress=c.log.progress,
                               total_steps=c.train.total_steps, wandb_project=c.log.wandb_project,
                               wandb_mode=c.log.wandb_mode, config=json.loads(c.to_json()))
        cleanup.callback(writer.close)
    engine_mesh = distributed.engine_mesh(c.mesh.to_dict(), c.rollout.engine_devices if c.rollout.engine == "jax" else 0)
    engine_model = distributed.engine_model(trainer, engine_mesh)  # every process joins the gather
    if main:
        engine = build_engine(c, engine_model, max_model_len, version)
        cleanup.callback(engine.shutdown)
    if engine is not None:
        engine.set_rng_state(rng.get("engine"))
    last, skipped_in_a_row, save_due, last_good = {}, 0, False, ckpt.latest_step()

    def state(done_steps: int, rollout=april) -> dict:
        """The checkpoint meta after `done_steps` steps (APRIL's state from `rollout`, if given)."""
        rng = {"engine": engine.rng_state() if engine is not None else None,  # None: not process 0
               "reward_failures": reward.failures, "reward_timeouts": reward.timeouts}
        return {"step": done_steps, "version": version, "skipped_steps": trainer.skipped_steps,
                "data": train_prompts.state_dict(), "rng": rng,
                "april": rollout.state_dict() if rollout is not None else None,
                "config": json.loads(c.to_json()), "model_config": trainer.model().cfg.to_hf_config()}

    def later(done_steps: int):
        """state(done_steps) for a stop signal's save, should one come: all but APRIL's state now;
        APRIL's (the large part: the partial buffer's tokens) as a cheap copy, made a dict only if asked."""
        meta, frozen = state(done_steps, None), frozen_copy(april)
        return lambda: dict(meta, april=frozen.state_dict())

    # the last finished step's checkpoint meta, when asked (None: nothing a fresh run could not redo)
    finished = later(start) if warmed_up or start == latest else None
    compile_clock.install()
    for step in range(start, c.train.total_steps):
        t0, compile0 = time.perf_counter(), compile_clock.seconds()
        groups, metrics, batch, shared = [], {}, None, {}
        if engine is not None and stop.signum is None:  # process 0
            # a fresh run's step 0 scores the policy it starts from (the baseline RL improves on); later
            # evals score the policy after their step's update: `eval/version` says which
            start_eval = evaluate(engine, eval_prompts, eval_scorer, c, stop_ids, version) if step == 0 and c.eval.every else {}
            with contextlib.suppress(distributed.Abandoned):  # a signal gives the rollout up
                groups, metrics = april.collect(stop.watching(engine), version)
            metrics.update(start_eval)
            t1, compile1 = time.perf_counter(), compile_clock.seconds()
            if stop.signum is None:  # a signal during the rollout (a reward worker it killed?) abandons it too
                if groups:
                    batch = groups_to_batch(groups, advantage_mode=c.loss.advantage, batch_norm=c.loss.advantage_batch_norm)
                    shared["rewards_failed"] = all(s.metadata.get("reward_failed") for g in groups for s in g.samples)
                engine.sleep()
        else:
            t1, compile1 = t0, compile0
        if engine is not None:
            shared["stop"] = stop.signum  # process 0 decides; every process gets it with the batch
        batch, shared = distributed.broadcast_batch(batch, shared)  # the other processes wait here
        if shared.get("stop"):
            stop.signum = shared["stop"]
            # every process is here at the same step: the collective save of the last finished one
            done = ckpt.write_now(finished and finished(), trainer.params, trainer.opt_state, last_good)
            raise Stopped.after(stop.signum, done, c.train.total_steps, ckpt.directory)
        if batch is None:
            raise ConfigError("the dataset ran out of prompts before the step's groups were complete")
        rewards_failed = shared["rewards_failed"]
        if rewards_failed:  # nothing to learn from: a broken reward function is not a zero reward
            trainer.skipped_steps += 1
            metrics.update({"train/skipped": 1.0, "train/skipped_steps": trainer.skipped_steps})
        else:
            metrics.update(trainer.update(batch, version, c.train.num_iterations))  # pi_old once, then epochs
        skipped = metrics["train/skipped"] > 0
        t2 = time.perf_counter()
        version += 1
        # the simulated engine has no model: the trainer's own state (no copy), not a gather to process 0
        weights = distributed.engine_state(trainer, engine_mesh) if c.rollout.engine != "sim" else trainer.nnx_state()
        if engine is not None:
            engine.wake_up()
            engine.update_weights(weights, version)
        t3 = time.perf_counter()
        # compile seconds inside the rollout (engine programs met for the first time) and the step
        metrics.update({"time/rollout_compile_s": compile1 - compile0,
                        "time/compile_s": compile_clock.seconds() - compile0})
        metrics.update({"time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/sync_s": t3 - t2,
                        "time/elapsed_s": t3 - started,  # since the run began: warm-up and compiles included
                        "version": version})
        if c.eval.every and (step + 1) % c.eval.every == 0 and engine is not None:
            metrics.update(evaluate(engine, eval_prompts, eval_scorer, c, stop_ids, version))
        if main:
            with open(workdir / "delivered.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "uids": [g.prompt.uid for g in groups]}) + "\n")
        skipped_in_a_row = skipped_in_a_row + 1 if skipped else 0
        finished = later(step + 1)
        # A checkpoint is written only after a step that trained: a resume then redoes the skipped ones.
        save_due = save_due or (step + 1) % c.checkpoint.every == 0 or step + 1 == c.train.total_steps
        if save_due and not skipped:
            t4 = time.perf_counter()
            ckpt.save(step + 1, trainer.params, trainer.opt_state, state(step + 1))
            if hasattr(engine, "release_held"):  # a run resumed from here holds no KV: neither does this one
                engine.release_held()
            metrics["time/ckpt_s"] = time.perf_counter() - t4
            save_due, last_good = False, step + 1
        metrics.update({"reward/failures": reward.failures, "reward/timeouts": reward.timeouts})  # eval's too
        if writer is not None:
            writer.write(step, metrics)
        last = metrics
        if skipped_in_a_row >= c.train.max_skipped_steps or (skipped and step + 1 == c.train.total_steps):
            why = ("every reward failed (an exception, NaN or a timeout)" if rewards_failed else
                   f"non-finite loss, gradient or updated parameters (loss {metrics.get('train/loss')}, "
                   f"grad norm {metrics.get('train/grad_norm')})")
            kept = f"{ckpt.directory / str(last_good)}" if last_good is not None else "none written"
            if skipped_in_a_row >= c.train.max_skipped_steps:
                raise TrainingError(f"stopped after {skipped_in_a_row} skipped steps in a row "
                                    f"(train.max_skipped_steps={c.train.max_skipped_steps}) at step {step}: {why}; "
                                    f"last good checkpoint: {kept}")
            raise TrainingError(f"the run ended on {skipped_in_a_row} skipped step(s) (the last: step {step}): {why}; "
                                f"last good checkpoint: {kept} (rerun the same command to redo the skipped steps)")
    return last  # a signal during the last step's update: it finished, its checkpoint is written, done


USAGE = """usage: python -m april_jax.train --config FILE [--config.KEY=VALUE ...]
       python -m april_jax.train --help [KEY.PREFIX]   (e.g. --help rollout, --help loss.kl_coef)

FILE is a Python file whose get_config() returns the config (configs/*.py); --config.KEY=VALUE
overrides one key. Keys (type, default; allowed values), each with what it does:
"""


def help_prefix(argv: list[str]) -> str | None:
    """The KEY.PREFIX of `--help [PREFIX]` / `--help=PREFIX` / `-h` ('' for all keys), or None."""
    for i, arg in enumerate(argv[1:], 1):
        if arg.startswith("--help="):
            return arg.split("=", 1)[1]
        if arg in ("--help", "-h", "--helpfull"):
            following = argv[i + 1] if i + 1 < len(argv) else ""
            return "" if following.startswith("-") else following
    return None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    prefix = help_prefix(argv)
    if prefix is not None:
        try:
            keys = config_lib.help_text(prefix)
        except ConfigError as e:
            fail(str(e))
        print((USAGE + "\n" if not prefix else "") + keys)
        return
    stop = distributed.StopSignal().install()  # from here on a signal only asks the loop to stop
    c = None
    try:
        c = load_config(argv)
        run(c, stop)
    except Stopped as e:
        print(e.line, file=sys.stderr)
        raise SystemExit(e.code) from None
    except ConfigError as e:
        fail(str(e))
    except OSError as e:
        if isinstance(e, FileNotFoundError):  # a path in the config: the message names it
            fail(str(e))
        if e.errno not in DISK_ERRORS:
            raise
        # a full disk, or a folder the run cannot write: the checkpoints written before are intact
        fail(f"{e.filename or (c and c.workdir) or 'writing the run'}: {e.strerror or e}{RERUN}")
    except (ValueError, TrainingError) as e:
        from april_jax.data.dataset import DataError
        from april_jax.data.tokenizer import TokenizerError
        from april_jax.errors import CheckpointError

        if isinstance(e, (DataError, CheckpointError, TokenizerError, TrainingError)):
            fail(str(e))
        if DISK_FULL_TEXT in str(e):  # orbax reports tensorstore's write errors as ValueError
            where = re.search(r"/[^\"'\s]*/checkpoints/\d+", str(e))
            fail(f"writing checkpoint {where.group(0) if where else ''}: {DISK_FULL_TEXT}{RERUN}")
        raise
    except RuntimeError as e:
        from april_jax.rollout.vllm.server import VllmStartError

        if isinstance(e, VllmStartError):  # a server that cannot start: its own reason, not our traceback
            fail(str(e))
        raise
    finally:
        stop.uninstall()


DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
DISK_FULL_TEXT = "No space left on device"
RERUN = " (the checkpoints before it are intact: fix this and rerun the same command to resume)"


if __name__ == "__main__":
    main()
