"""The vLLM sidecar: a real vLLM OpenAI server generates, the JAX trainer keeps the model.

- `engine.VllmEngine`: the trainer's client (streams, abort, recovery, weight sync).
- `server.VllmServer`: launches one server we own (loopback, random key, pidfile) through
- `sidecar`: the parent-death watchdog that runs the server and takes its process group down
  with the trainer.
- `auth.RequireKey`: ASGI middleware added to vLLM's app: every route needs the key.
- `worker_ext.WeightUpdateExt`: runs inside vLLM's worker; loads weights from the run's own
  transport folder (safetensors: JSON header + raw bytes, never pickle).

This `__init__` imports nothing: `auth`, `sidecar` and `worker_ext` are imported by the vLLM
interpreter (another virtualenv, without jax or numpy).
"""
