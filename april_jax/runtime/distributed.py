"""Several JAX processes (one per host, or N on one machine): joining the job and the few
collectives the training loop needs.

The design (multi-controller JAX, one process per host): every process runs `train.py`; the
mesh spans every process's devices and the policy update is one SPMD program that all of them
run. **Process 0 owns the rollout**: it alone holds the rollout engine, the APRIL state, the data
position, the reward workers and everything written to the workdir (metrics, logs,
`delivered.jsonl`, TensorBoard/W&B, `config.json`). After each rollout it broadcasts the batch
(exact bytes) and whether every reward failed; the other processes wait in that broadcast. Why
not one engine per process: APRIL's decisions depend on when rewards come back (worker timing),
so replicas would diverge; one owner keeps a single, checkpointed APRIL state.

Weights to the engine: the trainer's parameters are sharded over all processes, so each sync
gathers them one parameter at a time (a collective every process joins; peak memory one
parameter) to host on process 0, which hands them to its engine once (jax engine: placed on a
mesh of process 0's local devices, or the first `rollout.engine_devices` of them; vLLM: sent to
the servers once). In one process nothing changes: the engine reads the trainer's own sharded
arrays (unless `rollout.engine_devices` asks for fewer devices: then a copy on those).

Checkpoints: orbax is called by every process (each writes the shards it holds; the JSON meta is
written by process 0), so a checkpoint restores on any process count.

Environment (the standard `jax.distributed` variables): JAX_COORDINATOR_ADDRESS (host:port of
process 0), JAX_NUM_PROCESSES, JAX_PROCESS_ID; under SLURM (srun, SLURM_NTASKS > 1) JAX finds
them itself. `python -m april_jax.cli.launch --nprocs N` sets them for N local processes.

Where the coordinator listens: process 0 runs JAX's coordinator service. When
JAX_COORDINATOR_ADDRESS names this machine's loopback (127.0.0.1, ::1, localhost: what
`april_jax.cli.launch` sets) it binds that address only, so nothing outside the machine can reach
it. On a cluster the other hosts must reach it, and JAX binds every interface ([::]:PORT) by
default: set JAX_COORDINATOR_BIND_ADDRESS=IP:PORT to the cluster network's interface of the
first host (the job's private network) so that it does not listen on a public one.

Stopping on SIGTERM / SIGINT (a scheduler's preemption, Ctrl-C): `StopSignal` only records the
signal; process 0 decides at its next check and the decision travels with the step's broadcast,
so every process leaves the loop at the same step and joins the same (collective) checkpoint save.
"""

from __future__ import annotations

import json
import os

import numpy as np

ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
BIND_VAR = "JAX_COORDINATOR_BIND_ADDRESS"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def loopback_bind_address(coordinator_address: str) -> str | None:
    """The address the coordinator should bind when `coordinator_address` is a loopback one (the
    same host and port), else None (JAX's default: every interface, for a multi-host job)."""
    host, _, port = coordinator_address.rpartition(":")
    if host in LOOPBACK_HOSTS or host.startswith("127."):
        return f"{'127.0.0.1' if host == 'localhost' else host}:{port}"
    return None


class Abandoned(Exception):
    """The rollout in progress was given up on a stop signal."""


class _StopAwareEngine:
    """A rollout engine whose `step()` raises Abandoned once a stop signal arrived; everything
    else is the engine's own."""

    def __init__(self, engine, stop: StopSignal):
        self.engine, self.stop = engine, stop

    def step(self):
        if self.stop.signum is not None:
            raise Abandoned
        return self.engine.step()

    def generate(self, requests) -> dict:
        """The engine's `generate`, stepping here: an eval gives up at the next step after a signal."""
        self.engine.submit(requests)
        out = {}
        while self.engine.has_unfinished():
            out.update((r.request_id, r) for r in self.step())
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


class StopSignal:
    """SIGTERM / SIGINT / SIGHUP (a closed terminal) handlers that only record the signal: the training loop checks
    `signum` at safe points (a handler that raised could interrupt a checkpoint half-written or a
    collective the other processes are in). A second signal while stopping changes nothing but
    a note on stderr: the checkpoint is being written, and only SIGKILL cuts it short."""

    SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    @property
    def name(self) -> str:
        import signal

        return signal.Signals(self.signum).name if self.signum else ""

    def watching(self, engine):
        """`engine` for a rollout that a stop signal gives up (Abandoned from its next step): its
        partial state is not kept, the checkpoint is of the last finished step."""
        return _StopAwareEngine(engine, self)

    def install(self) -> StopSignal:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, _frame) -> None:
        import signal

        if self.signum is None:
            self.signum = signum
            return
        # os.write: safe in a handler that may have interrupted a print
        os.write(
            2,
            f"{signal.Signals(signum).name} again: still writing the checkpoint; SIGKILL stops at once "
            f"(the last checkpoint stays intact)\n".encode(),
        )


def requested() -> bool:
    """True if the environment asks for a multi-process job."""
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) or os.environ.get("SLURM_NTASKS", "1") != "1"


def initialize() -> None:
    """Join the job the environment describes (no-op for a single process). CPU devices talk
    through gloo: XLA:CPU's default has no cross-process collectives."""
    if not requested():
        return
    import jax

    from april_jax.config import ConfigError

    kw = {}
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        missing = [v for v in ENV_VARS[1:] if not os.environ.get(v)]
        if missing:
            raise ConfigError(
                f"JAX_COORDINATOR_ADDRESS is set but not {', '.join(missing)} "
                f"(set all of {', '.join(ENV_VARS)}, or use python -m april_jax.cli.launch)"
            )
        try:
            kw = dict(
                coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                process_id=int(os.environ["JAX_PROCESS_ID"]),
            )
        except ValueError:
            raise ConfigError(
                f"JAX_NUM_PROCESSES={os.environ['JAX_NUM_PROCESSES']!r} and "
                f"JAX_PROCESS_ID={os.environ['JAX_PROCESS_ID']!r} must be integers"
            ) from None
        bind = os.environ.get(BIND_VAR) or loopback_bind_address(kw["coordinator_address"])
        if bind:
            kw["coordinator_bind_address"] = bind
    # JAX's preemption service catches SIGTERM in C++ (and only logs it): the trainer's StopSignal
    # handles it instead, and its decision travels with the step's broadcast
    jax.config.update("jax_enable_preemption_service", False)
    platforms = os.environ.get("JAX_PLATFORMS", "") or jax.config.jax_platforms or ""
    if platforms in ("", "cpu") and jax.config.jax_cpu_collectives_implementation in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kw)


def process_index() -> int:
    import jax

    return jax.process_index()


def is_main() -> bool:
    """Process 0: the one that owns the rollout and writes to the workdir."""
    return process_index() == 0


def multiprocess() -> bool:
    import jax

    return jax.process_count() > 1


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (e.g. after process 0 wrote a file the others read)."""
    if multiprocess():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _broadcast_bytes(payload: bytes | None) -> bytes:
    """Process 0's bytes on every process (others pass None). Sent as uint8, so what arrives is
    bit-exact (a float broadcast by summing zeros would turn -0.0 into 0.0)."""
    from jax.experimental import multihost_utils

    size = np.array([len(payload) if is_main() else 0], np.int32)
    size = int(multihost_utils.broadcast_one_to_all(size)[0])
    buffer = np.frombuffer(payload, np.uint8) if is_main() else np.zeros(size, np.uint8)
    return multihost_utils.broadcast_one_to_all(buffer).tobytes()


def broadcast_batch(batch: dict | None, extra: dict | None = None) -> tuple[dict | None, dict]:
    """(batch, extra) from process 0 on every process: `batch` maps names to numpy arrays (or
    None), or is None (no batch: the step stops); `extra` is JSON-able. One process: returned as given."""
    if not multiprocess():
        return batch, extra or {}
    payload = None
    if is_main():
        arrays = {k: np.ascontiguousarray(v) for k, v in (batch or {}).items() if v is not None}
        header = {
            "extra": extra or {},
            "none": [k for k, v in (batch or {}).items() if v is None],
            "no_batch": batch is None,
            "arrays": [[k, str(a.dtype), list(a.shape)] for k, a in arrays.items()],
        }
        head = json.dumps(header).encode()
        payload = len(head).to_bytes(8, "little") + head + b"".join(a.tobytes() for a in arrays.values())
    data = _broadcast_bytes(payload)
    n = int.from_bytes(data[:8], "little")
    header, offset, out = json.loads(data[8 : 8 + n]), 8 + n, {}
    if header["no_batch"]:
        return None, header["extra"]
    for name, dtype, shape in header["arrays"]:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        out[name] = np.frombuffer(data, dtype, count=int(np.prod(shape, dtype=np.int64)), offset=offset).reshape(shape)
        offset += size
    out.update({k: None for k in header["none"]})
    return out, header["extra"]


def gather_to_main(tree):
    """The pytree's arrays (sharded over every process) as numpy arrays on process 0, one leaf at
    a time so that no device holds more than one whole parameter; None on the other processes.
    Every process must call it (it is a collective)."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for x in leaves:
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            out.append(np.asarray(x) if is_main() else None)
            continue
        replicated = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
        full = _identity(replicated)(x)
        out.append(np.asarray(full.addressable_data(0)) if is_main() else None)
        del full
    return jax.tree.unflatten(treedef, out) if is_main() else None


_IDENTITIES: dict = {}


def _identity(sharding):
    import jax

    if sharding not in _IDENTITIES:
        _IDENTITIES[sharding] = jax.jit(lambda x: x, out_shardings=sharding)
    return _IDENTITIES[sharding]


def engine_mesh(axes: dict, devices: int = 0):
    """The mesh the rollout engine runs on, or None when it reads the trainer's own arrays (one
    process, all devices). Several processes: process 0's local devices (the first `devices` of
    them when > 0), with the run's mesh axes if they fit, else all on fsdp."""
    import jax

    from april_jax.config import ConfigError
    from april_jax.models import sharding

    local = jax.local_devices()
    if devices > len(local):
        raise ConfigError(f"config key 'rollout.engine_devices'={devices}: this process has only {len(local)} devices")
    if not multiprocess() and devices in (0, len(local)):
        return None
    local = local[: devices or len(local)]
    try:
        return sharding.make_mesh(axes, devices=local)
    except ValueError:
        return sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices=local)


def engine_state(trainer, mesh):
    """The trainer's parameters as an nnx.State the rollout engine can use (with LoRA: the base
    with the adapters merged in, the plain model's state).

    `mesh` None (one process): the trainer's own arrays (no copy). Else gathered to process 0 and
    placed on `mesh` (process 0's devices, sharded by the same logical-axis rules); None on the
    other processes. Every process must call it."""
    if mesh is None:
        return trainer.nnx_state()
    import jax
    from flax import nnx

    from april_jax.models.sharding import logical_sharding
    from april_jax.rl.train_step import _nest

    lora = getattr(trainer, "lora", None) is not None
    # Under LoRA `params` are the adapters, which the engine's plain model has no place for: every
    # process merges its shards of the base (a program over the global arrays, so all run it)
    # and process 0 gathers the merged weights.
    params = trainer._merge_fn(trainer.base, trainer.params) if lora else trainer.params
    host = gather_to_main(params)
    if not is_main():
        return None
    view = trainer._plain if lora else trainer.model
    flat = nnx.to_flat_state(nnx.state(view(host)))
    shardings = _nest(
        {p: logical_sharding(v.get_metadata()["logical_axes"], v.get_value().shape, mesh) for p, v in flat}
    )
    return nnx.state(view(jax.device_put(host, shardings)))


def engine_model(trainer, mesh):
    """The model the rollout engine starts from: the trainer's own when `mesh` is None; else a copy
    on `mesh` on process 0, None on the others. Every process must call it."""
    if mesh is None:
        return trainer.model()
    from flax import nnx

    state = engine_state(trainer, mesh)
    if state is None:
        return None
    graphdef = trainer._plain_graphdef if getattr(trainer, "lora", None) is not None else trainer.graphdef
    model = nnx.merge(graphdef, state)
    model.mesh = mesh  # sharding constraints inside the model name this mesh, not the training one
    return model


def save_pretrained(model, path) -> None:
    """`hf.save_pretrained` of a model sharded over every process: gathered, written by
    process 0, and every process waits until the files are there. Every process must call it."""
    from april_jax.models import hf

    if not multiprocess():
        hf.save_pretrained(model, path)
        return
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    host = gather_to_main(nnx.to_pure_dict(state))
    if is_main():
        copy = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(copy, host)
        hf.save_pretrained(nnx.merge(graphdef, copy), path)
    barrier(f"saved {path}")
