"""The vLLM sidecar: a real vLLM OpenAI server generates, the JAX trainer keeps the model.

- `engine.VllmEngine`: the trainer's client (streams, abort, recovery, weight sync).
- `server.VllmServer`: launches one server we own (loopback, random key, pidfile) through
- `sidecar`: the parent-death watchdog that runs the server and takes its whole process tree
  down with the trainer.
- `proctree`: finds every process of a server tree by the token in its environment (also those
  that left the group or lost their parent) and stops it, with the shared memory it mapped.
- `auth.RequireKey`: ASGI middleware added to vLLM's app: every route needs the key.
- `worker_ext.WeightUpdateExt`: runs inside vLLM's worker; loads weights from the run's own
  transport folder (safetensors: JSON header + raw bytes, never pickle).

This `__init__` imports nothing: `auth`, `proctree`, `sidecar` and `worker_ext` are imported by
the vLLM interpreter (another virtualenv, without jax or numpy).
"""
