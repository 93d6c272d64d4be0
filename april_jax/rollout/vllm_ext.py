"""vLLM worker extension (`--worker-extension-cls april_jax.rollout.vllm_ext.WeightUpdateExt`).

Runs inside the vLLM worker process, so it imports only torch and safetensors. It loads named
tensors with the model runner's reload path: plain `model.load_weights` fails on vLLM's CPU
backend (linear weights are prepacked) and leaves a half-updated model.
"""


class WeightUpdateExt:
    def april_update_from_file(self, path: str) -> int:
        """Load every tensor of the safetensors file at `path` (e.g. a /dev/shm buffer)."""
        import safetensors.torch

        named = list(safetensors.torch.load_file(path).items())
        self.model_runner.reload_weights(weights_iterator=iter(named))
        return len(named)

    def april_update_from_cuda_ipc(self, payload: str) -> int:
        """Map the trainer's CUDA buffer (see `april_jax.weights.CudaIpcBucket`) and load from it.
        UNTESTED until a GPU run proves it."""
        import base64
        import pickle

        import torch

        meta, (rebuild, args) = pickle.loads(base64.b64decode(payload))
        args = list(args)
        args[6] = self.device.index  # same physical GPU, but CUDA_VISIBLE_DEVICES may renumber it
        buffer = rebuild(*args)
        named = [(name, buffer[off:off + n].view(getattr(torch, dtype)).view(shape))
                 for name, dtype, shape, off, n in meta]
        self.model_runner.reload_weights(weights_iterator=iter(named))
        torch.cuda.synchronize()
        return len(named)
