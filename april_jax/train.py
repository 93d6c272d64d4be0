"""The training recipe: python -m april_jax.train --config configs/tiny.py [--config.a.b=value ...]

One step per rollout batch, each a short named function below:

    generate (APRIL rollout, rewards scored beside the engine) -> batch (advantages) -> update the
    policy -> sync weights to the engine -> evaluate -> save a checkpoint -> write the metrics

Restarting with the same workdir resumes from the latest checkpoint (params, optimiser state, step,
version, RNG, data position, APRIL partial buffer: training/run_state.py). What a run builds is in
april_jax/training/; the command line (arguments, --help, errors as one line, SIGTERM / SIGINT) is
april_jax/cli/train.py, which `python -m april_jax.train` runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from april_jax import config as config_lib
from april_jax.config import ConfigError
from april_jax.runtime import distributed
from april_jax.runtime.errors import Stopped, TrainingError
from april_jax.training.plan import Plan, plan_for_run, write_plan
from april_jax.training.run_state import RunState
from april_jax.training.task import Task, build_task


def run(c, stop: distributed.StopSignal | None = None) -> dict:
    """Train `c` to train.total_steps (resuming from its workdir); the last step's metrics."""
    from april_jax.runtime import compile_cache
    from april_jax.runtime.workdir_lock import WorkdirLock, check_workdir

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
    from april_jax.runtime import compile_clock

    # Everything that can reject bad input runs before the workdir is touched.
    task = build_task(c, c.model.path or None)
    with contextlib.ExitStack() as cleanup:  # closes what was opened, in reverse, however the run ends
        cleanup.callback(task.reward.close)  # the reward workers started with the task
        from april_jax.training.builders import check_vllm_attach

        check_vllm_attach(c)  # servers to attach to: their form, folder, /health and key
        # before JAX's backend starts (the mesh starts it): the plan sets its allocator
        plan = plan_for_run(c, task.vocab_size, log=lambda line: print(line, file=sys.stderr))
        mesh = sharding.make_mesh(c.mesh.to_dict())
        run = _build(c, workdir, lock, mesh, task, cleanup, stop, started, plan)
        compile_clock.install()
        last = {}
        for step in range(run.state.step, c.train.total_steps):
            last = _train_step(run, step)
        return last  # a signal during the last step's update: it finished, its checkpoint is written, done


@dataclasses.dataclass
class Run:
    """What a training run holds while it trains; process 0 alone has the engine and the writer."""

    c: object
    workdir: Path
    task: Task
    trainer: object
    april: object
    ckpt: object
    state: RunState
    eval_scorer: object
    stop: distributed.StopSignal
    started: float
    plan: Plan
    writer: object = None
    engine: object = None
    engine_mesh: object = None
    last_good: int | None = None  # the newest checkpoint of a step that trained
    finished: Callable[[], dict] | None = None  # the last finished step's meta (None: nothing to save)
    save_due: bool = False  # a save came due at a skipped step: the next step that trains saves
    skipped_in_a_row: int = 0


# ---- building the run ----
def _build(c, workdir: Path, lock, mesh, task: Task, cleanup, stop, started: float, plan: Plan) -> Run:
    from april_jax.rl.failed_rewards import MarkFailedRewards
    from april_jax.rl.rewards import GroupScorer
    from april_jax.rollout.april import April

    trainer, ckpt, warmed_up = _build_trainer(c, workdir, lock, mesh, task, cleanup, plan, stop)
    scorer = GroupScorer(task.reward, task.decode, task.decode_prompt, _overlong_penalty(c))
    april = April(config_lib.rollout_cfg(c, task.stop_ids), task.train, MarkFailedRewards(scorer, task.reward))
    run = Run(
        c,
        workdir,
        task,
        trainer,
        april,
        ckpt,
        RunState(c, trainer, april, task.train, task.reward),
        GroupScorer(task.reward, task.decode, task.decode_prompt),
        stop,
        started,
        plan,
    )
    latest = _resume(run)
    if distributed.is_main():
        _open_metrics(run, cleanup)
    _start_engine(run, cleanup)
    run.last_good = ckpt.latest_step()
    if warmed_up or run.state.step == latest:  # else nothing a fresh run could not redo
        run.finished = run.state.later(run.state.step)
    return run


def _build_trainer(c, workdir: Path, lock, mesh, task: Task, cleanup, plan: Plan, stop):
    """The policy's Trainer (after the supervised warm-up of a fresh run), the run's Checkpointer,
    and whether the run warmed up."""
    import jax

    from april_jax.rl.train_step import Trainer
    from april_jax.runtime.checkpoints import Checkpointer
    from april_jax.training.builders import build_lora, build_model, build_reference, check_vocab

    check_vocab(c, task.vocab_size)
    mesh = mesh if jax.device_count() > 1 else None
    model = build_model(c, mesh, task.vocab_size)
    if lock is not None:
        lock.acquire()
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(workdir / "checkpoints", keep=c.checkpoint.keep)
    cleanup.callback(ckpt.close)
    fresh = ckpt.latest_step() is None
    ckpt.check_resumable(json.loads(c.to_json()), model.cfg.to_hf_config())
    if distributed.is_main():  # process 0 owns the rollout and the workdir's files (runtime/distributed.py)
        (workdir / "config.json").write_text(c.to_json(indent=2))
        write_plan(plan, workdir)
        # on GPUs the whole table (what runs where is worth reading there); a CPU run one line
        print(plan.table() if plan.devices.is_gpu else plan.summary_line(workdir / "plan.txt"), file=sys.stderr)
    warmed_up = fresh and bool(c.warmup.steps)
    if warmed_up:  # fresh run: supervised warm-up before RL on the task's examples
        _warm_up(c, model, task, stop)
    trainer = Trainer(
        model,
        config_lib.loss_cfg(c),
        config_lib.optimizer_cfg(c),
        mesh=mesh,
        micro_batch_size=c.train.micro_batch_size or None,
        temperature=c.rollout.temperature or 1.0,
        reference=build_reference(c, mesh, model, workdir, fresh=fresh),
        lora=build_lora(c, mesh, model, workdir, fresh=fresh),
    )
    return trainer, ckpt, warmed_up


def _warm_up(c, model, task: Task, stop) -> None:
    from april_jax.rl import sft

    examples = task.warmup_examples(c.seed, 20_000)
    stopping = lambda: stop.signum is not None  # noqa: E731
    losses = sft.warmup(
        model,
        examples,
        steps=c.warmup.steps,
        lr=c.warmup.lr,
        batch_size=c.warmup.batch_size,
        seed=c.seed,
        should_stop=stopping,
    )
    if stopping():  # a fresh run: nothing to save, a rerun warms up again from the same seed
        raise Stopped.after(stop.signum, None, c.train.total_steps, None)
    print(f"supervised warm-up: {c.warmup.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}", file=sys.stderr)


def _overlong_penalty(c):
    """DAPO's soft overlong punishment added to each reward, or None (reward.overlong_buffer=0)."""
    from april_jax.rl.advantages import overlong_penalty

    def penalised(sample, r):
        return r + float(
            overlong_penalty(
                len(sample.response_ids), c.rollout.max_response_len, c.reward.overlong_buffer, c.reward.overlong_factor
            )
        )

    return penalised if c.reward.overlong_buffer else None


def _resume(run: Run) -> int | None:
    """Restore the latest checkpoint into the run, if there is one; its step (None: a fresh run)."""
    trainer = run.trainer
    restored = run.ckpt.restore_latest(
        trainer.params,
        trainer.opt_state,
        trainer.param_shardings,
        trainer.opt_shardings,
        log=lambda line: print(line, file=sys.stderr),
    )
    if restored is None:
        return None
    latest, trainer.params, trainer.opt_state, meta = restored
    run.state.restore(meta)
    print(
        f"resumed from {run.ckpt.directory / str(latest)} (step {run.state.step}, version {run.state.version}, "
        f"{len(run.april.buffer)} buffered groups)",
        file=sys.stderr,
    )
    return latest


def _open_metrics(run: Run, cleanup) -> None:
    """Process 0: the logs cut back to the resumed step, and the metrics writer."""
    from april_jax.training.metrics import MetricsWriter, truncate_log

    c, workdir = run.c, run.workdir
    for name in ("metrics.jsonl", "delivered.jsonl"):
        truncate_log(workdir / name, run.state.step)
    run.writer = MetricsWriter(
        workdir,
        tensorboard=c.log.tensorboard,
        progress=c.log.progress,
        total_steps=c.train.total_steps,
        wandb_project=c.log.wandb_project,
        wandb_mode=c.log.wandb_mode,
        config=json.loads(c.to_json()),
    )
    cleanup.callback(run.writer.close)


def _max_model_len(c) -> int:
    """The longest prompt + response of the run: the engine's context and the train batch's widest length."""
    return c.rollout.max_model_len or (c.data.max_prompt_len + c.rollout.max_response_len)


def _start_engine(run: Run, cleanup) -> None:
    """The rollout engine on process 0, from the trainer's weights (every process joins the gather)."""
    from april_jax.training.builders import build_engine

    c = run.c
    run.engine_mesh = distributed.engine_mesh(
        c.mesh.to_dict(), c.rollout.engine_devices if c.rollout.engine == "jax" else 0
    )
    engine_model = distributed.engine_model(run.trainer, run.engine_mesh)
    if distributed.is_main():
        run.engine = build_engine(c, engine_model, _max_model_len(c), run.state.version, run.plan)
        cleanup.callback(run.engine.shutdown)
        run.state.attach_engine(run.engine)


# ---- one step ----
def _train_step(run: Run, step: int) -> dict:
    """Generate, train on the batch, sync the weights, evaluate, save and log: the step's metrics."""
    from april_jax.runtime import compile_clock

    t0, compile0 = time.perf_counter(), compile_clock.seconds()
    groups, metrics = _generate(run, step)
    t1, compile1 = time.perf_counter(), compile_clock.seconds()
    batch, shared = _share_batch(run, groups)
    if shared.get("stop"):
        _stop(run, shared["stop"])
    if batch is None:
        raise ConfigError("the dataset ran out of prompts before the step's groups were complete")
    metrics.update(_update(run, batch, shared["rewards_failed"]))
    skipped = metrics["train/skipped"] > 0
    t2 = time.perf_counter()
    _sync_weights(run)
    t3 = time.perf_counter()
    # compile seconds inside the rollout (engine programs met for the first time) and the step
    metrics.update(
        {"time/rollout_compile_s": compile1 - compile0, "time/compile_s": compile_clock.seconds() - compile0}
    )
    metrics.update(
        {
            "time/rollout_s": t1 - t0,
            "time/train_s": t2 - t1,
            "time/sync_s": t3 - t2,
            "time/elapsed_s": t3 - run.started,  # since the run began: warm-up and compiles included
            "version": run.state.version,
        }
    )
    if run.c.eval.every and (step + 1) % run.c.eval.every == 0:
        metrics.update(_evaluate(run))
    _log_delivered(run, step, groups)
    run.skipped_in_a_row = run.skipped_in_a_row + 1 if skipped else 0
    run.finished = run.state.later(step + 1)
    metrics.update(_save_if_due(run, step + 1, skipped))
    metrics.update(
        {"reward/failures": run.task.reward.failures, "reward/timeouts": run.task.reward.timeouts}
    )  # eval's too
    run.task.reward.failure_log.write(run.workdir, step, trained=not skipped)  # what failed, how: the workdir
    if run.writer is not None:
        run.writer.write(step, metrics)
    _check_skipped(run, step, skipped, shared["rewards_failed"], metrics)
    return metrics


def _generate(run: Run, step: int) -> tuple[list, dict]:
    """Process 0: the step's rollout (APRIL: generate, score beside the engine, terminate), after
    the baseline eval before a fresh run's first step. Nothing elsewhere, or once a signal came."""
    groups, metrics = [], {}
    if run.engine is None or run.stop.signum is not None:
        return groups, metrics
    # a fresh run's step 0 scores the policy it starts from (the baseline RL improves on); later
    # evals score the policy after their step's update: `eval/version` says which
    start_eval = _evaluate(run) if step == 0 and run.c.eval.every else {}
    with contextlib.suppress(distributed.Abandoned):  # a signal gives the rollout up
        groups, metrics = run.april.collect(run.stop.watching(run.engine), run.state.version)
    metrics.update(start_eval)
    return groups, metrics


def _share_batch(run: Run, groups: list) -> tuple[dict | None, dict]:
    """Process 0 makes the groups a training batch (advantages included) and puts the engine to
    sleep; every process then gets the batch, whether every reward failed, and the stop decision."""
    from april_jax.rl.batch import groups_to_batch
    from april_jax.rl.failed_rewards import all_failed

    c, batch, shared = run.c, None, {}
    if run.engine is not None and run.stop.signum is None:  # a signal during the rollout abandons it too
        if groups:
            batch = groups_to_batch(
                groups,
                advantage_mode=c.loss.advantage,
                batch_norm=c.loss.advantage_batch_norm,
                max_len=_max_model_len(c),
            )
            shared["rewards_failed"] = all_failed(groups)
        run.engine.sleep()
    if run.engine is not None:
        shared["stop"] = run.stop.signum  # process 0 decides; every process gets it with the batch
    return distributed.broadcast_batch(batch, shared)  # the other processes wait here


def _stop(run: Run, signum: int) -> None:
    """Every process is here at the same step: the collective save of the last finished one, then Stopped."""
    run.stop.signum = signum
    if run.trainer.optimizer_offloaded:  # back for the save (the device state, as a scheduled save writes)
        if run.engine is not None:  # in the room of the engine's KV, which the run no longer needs
            run.engine.abort_all()  # a rollout given up part way leaves requests in flight
            run.engine.sleep()
        run.trainer.restore_optimizer()
    done = run.ckpt.write_now(run.finished and run.finished(), run.trainer.params, run.trainer.opt_state, run.last_good)
    raise Stopped.after(signum, done, run.c.train.total_steps, run.ckpt.directory)


def _update(run: Run, batch: dict, rewards_failed: bool) -> dict:
    """The policy update (pi_old once, then the epochs), or a skipped step when every reward failed."""
    trainer = run.trainer
    if rewards_failed:  # nothing to learn from: a broken reward function is not a zero reward
        trainer.skipped_steps += 1
        return {"train/skipped": 1.0, "train/skipped_steps": trainer.skipped_steps}
    trainer.restore_optimizer()  # from the host, if the plan offloaded it for the rollout
    return trainer.update(batch, run.state.version, run.c.train.num_iterations)


def _sync_weights(run: Run) -> None:
    """The next policy version to the engine (woken up from the update); the optimizer state to the
    host first when the plan offloads it, so that the engine's KV cache gets its room."""
    run.state.version += 1
    if run.plan.trainer["offload"]:
        run.trainer.offload_optimizer()
    # the simulated engine has no model: the trainer's own state (no copy), not a gather to process 0
    if run.c.rollout.engine != "sim":
        weights = distributed.engine_state(run.trainer, run.engine_mesh)
    else:
        weights = run.trainer.nnx_state()
    if run.engine is not None:
        run.engine.wake_up()
        run.engine.update_weights(weights, run.state.version)


def _evaluate(run: Run) -> dict:
    """Process 0: the held-out eval of the engine's current policy."""
    from april_jax.training.evaluation import evaluate

    if run.engine is None:
        return {}
    task = run.task
    try:  # a signal gives the eval up at the engine's next step: the stop saves what finished
        return evaluate(
            run.stop.watching(run.engine), task.eval_prompts, run.eval_scorer, run.c, task.stop_ids, run.state.version
        )
    except distributed.Abandoned:
        run.engine.abort_all()
        return {}


def _log_delivered(run: Run, step: int, groups: list) -> None:
    if distributed.is_main():
        with open(run.workdir / "delivered.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "uids": [g.prompt.uid for g in groups]}) + "\n")


def _save_if_due(run: Run, done_steps: int, skipped: bool) -> dict:
    """The checkpoint after `done_steps` steps when one is due; only after a step that trained (a
    resume then redoes the skipped ones)."""
    c = run.c
    run.save_due = run.save_due or done_steps % c.checkpoint.every == 0 or done_steps == c.train.total_steps
    if not run.save_due or skipped:
        return {}
    t = time.perf_counter()
    with _optimizer_on_device(run):
        run.ckpt.save(done_steps, run.trainer.params, run.trainer.opt_state, run.state.meta(done_steps))
    if hasattr(run.engine, "release_held"):  # a run resumed from here holds no KV: neither does this one
        run.engine.release_held()
    run.save_due, run.last_good = False, done_steps
    return {"time/ckpt_s": time.perf_counter() - t}


@contextlib.contextmanager
def _optimizer_on_device(run: Run):
    """An offloaded optimizer state back on the device while a checkpoint saves it (orbax and its
    finite check then read what an update leaves), the engine asleep meanwhile: the plan offloads
    when the state and the engine's KV cache do not fit together. The engine is idle here."""
    trainer = run.trainer
    if not trainer.optimizer_offloaded:
        yield
        return
    if run.engine is not None:
        run.engine.sleep()
    trainer.restore_optimizer()
    try:
        yield
    finally:
        trainer.offload_optimizer()
        if run.engine is not None:
            run.engine.wake_up()


def _check_skipped(run: Run, step: int, skipped: bool, rewards_failed: bool, metrics: dict) -> None:
    """Too many skipped steps in a row, or a run that ends on one: TrainingError, naming the last good checkpoint."""
    c, in_a_row = run.c, run.skipped_in_a_row
    if not (in_a_row >= c.train.max_skipped_steps or (skipped and step + 1 == c.train.total_steps)):
        return
    why = (
        f"every reward failed ({run.task.reward.failure_log.cause()})"
        if rewards_failed
        else f"non-finite loss, gradient or updated parameters (loss {metrics.get('train/loss')}, "
        f"grad norm {metrics.get('train/grad_norm')})"
    )
    kept = f"{run.ckpt.directory / str(run.last_good)}" if run.last_good is not None else "none written"
    if in_a_row >= c.train.max_skipped_steps:
        raise TrainingError(
            f"stopped after {in_a_row} skipped steps in a row "
            f"(train.max_skipped_steps={c.train.max_skipped_steps}) at step {step}: {why}; "
            f"last good checkpoint: {kept}"
        )
    raise TrainingError(
        f"the run ended on {in_a_row} skipped step(s) (the last: step {step}): {why}; "
        f"last good checkpoint: {kept} (rerun the same command to redo the skipped steps)"
    )


if __name__ == "__main__":
    from april_jax.cli.train import main

    main()
