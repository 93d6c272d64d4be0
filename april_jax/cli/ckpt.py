"""Inspect and export training checkpoints.

python -m april_jax.cli.ckpt inspect PATH [--json]     PATH: workdir, checkpoints dir or step dir
python -m april_jax.cli.ckpt export-hf PATH OUT        a transformers-loadable checkpoint (OUT new or empty,
                                                   or --force to replace the model files in it); a LoRA
                                                   run's adapters merged into its base
python -m april_jax.cli.ckpt export-peft PATH OUT      a LoRA run's adapters as PEFT loads them
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from april_jax.cli import prog
from april_jax.runtime.checkpoints import read_meta, resolve_step_dir
from april_jax.runtime.errors import CheckpointError


def describe(path) -> dict:
    import jax
    import orbax.checkpoint as ocp

    step_dir = resolve_step_dir(path)
    meta = read_meta(step_dir)
    md = ocp.StandardCheckpointer().metadata(step_dir / "params")
    tree = getattr(md, "item_metadata", md)
    params = []
    for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)
        params.append(
            {
                "name": name,
                "shape": list(leaf.shape),
                "dtype": str(leaf.dtype),
                "sharding": str(getattr(leaf, "sharding", None)),
            }
        )
    buffer = meta["april"]["buffer"]["groups"]
    samples = [s for g in buffer for s in g["samples"]]
    return {
        "path": str(step_dir),
        "items": ORBAX_ITEMS,
        "step": meta["step"],
        "policy_version": meta["version"],
        "data_position": meta["data"],
        "skipped_steps": meta["skipped_steps"],
        "num_params": sum(math.prod(p["shape"]) for p in params),
        "params": params,
        "buffer": {
            "groups": len(buffer),
            "complete_groups": sum(
                all(s["status"] in ("completed", "truncated") for s in g["samples"]) for g in buffer
            ),
            "partial_samples": sum(1 for s in samples if s["status"] == "aborted" and s["response_ids"]),
            "tokens": sum(len(s["response_ids"]) for s in samples),
        },
        "dropped_prompts": len(meta["april"]["dropped"]),
        "lora": _lora_info(meta),
    }


def _lora_keys(meta: dict) -> dict | None:
    """The run's model.lora_* keys, or None for full fine-tuning."""
    model = meta.get("config", {}).get("model", {})
    return model if model.get("lora_rank") else None


def _lora_info(meta: dict) -> dict | None:
    from april_jax.models.lora import parse_targets

    keys = _lora_keys(meta)
    if keys is None:
        return None
    return {
        "rank": keys["lora_rank"],
        "alpha": keys["lora_alpha"],
        "targets": list(parse_targets(keys["lora_targets"])),
    }


# How each item of a step was saved (runtime/checkpoints.py): with plain orbax, restore them by
# name with these args; `CheckpointManager(dir).restore(step)` without args knows no handler.
ORBAX_ITEMS = {
    "params": "ocp.args.StandardSave: the policy's parameters (a nested dict of arrays)",
    "opt_state": "ocp.args.StandardSave: the optax AdamW state (its own tree; restore it with a target)",
    "meta": "ocp.args.JsonSave: step, policy version, RNG, data position, APRIL buffer, config",
}
ORBAX_SNIPPET = """import orbax.checkpoint as ocp

mngr = ocp.CheckpointManager(CHECKPOINTS_DIR, item_names=("params", "opt_state", "meta"))
step = mngr.latest_step()
got = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
got.params["embed_tokens"], got.meta["version"]"""


def check_export_target(out, force: bool = False, step_dir=None) -> None:
    """OUT must be a new or empty directory, or --force: an export replaces model*.safetensors,
    the index and config.json of whatever checkpoint is there. It must not be inside the run's
    checkpoints folder (`step_dir`'s parent): checkpoint rotation deletes old steps whole."""
    out = Path(out)
    if step_dir is not None:
        checkpoints = Path(step_dir).resolve().parent
        if out.resolve() == checkpoints or checkpoints in out.resolve().parents:
            raise CheckpointError(
                f"{out}: inside the run's checkpoints folder {checkpoints}, whose old steps the "
                f"trainer deletes (checkpoint.keep); choose a folder outside it"
            )
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise CheckpointError(
            f"{out}: directory is not empty (an export would replace its model files); "
            f"choose a new directory or pass --force"
        )


def export_hf(path, out, force: bool = False) -> int:
    """Write the checkpoint at `path` as a Hugging Face checkpoint in `out`; the step exported."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from april_jax.models import hf, qwen3

    step_dir = resolve_step_dir(path)
    meta = read_meta(step_dir)
    check_export_target(out, force, step_dir)
    cfg = qwen3.Qwen3Config.from_hf_config(
        meta["model_config"], param_dtype=meta["model_config"].get("torch_dtype", "float32")
    )
    tokenizer_dir = tokenizer_source(meta)
    if cfg.eos_token_id is None:  # a model built from model.arch: the tokenizer's eos
        cfg = cfg.replace(eos_token_id=eos_token_id(tokenizer_dir, meta))
    abstract = nnx.eval_shape(lambda: qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    if _lora_keys(meta) is not None:
        params = _merged_lora_params(meta, cfg, step_dir)
    else:
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
        params = ocp.StandardCheckpointer().restore(step_dir / "params", target)
    nnx.replace_by_pure_dict(state, params)
    hf.save_pretrained(nnx.merge(graphdef, state), out)
    write_tokenizer(tokenizer_dir, out)
    return int(meta["step"])


def _lora_config(meta: dict):
    from april_jax.models.lora import LoRAConfig, parse_targets

    keys = _lora_keys(meta)
    return LoRAConfig(int(keys["lora_rank"]), float(keys["lora_alpha"]), parse_targets(keys["lora_targets"]))


def restore_adapters(meta: dict, cfg, step_dir) -> dict:
    """A LoRA checkpoint's adapters (the pure dict the Trainer trained)."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from april_jax.models import lora, qwen3

    lora_cfg = _lora_config(meta)
    abstract = nnx.eval_shape(lambda: lora.add_adapters(qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)), lora_cfg))
    _, adapters, _ = nnx.split(abstract, lora.LoRAParam, ...)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(adapters))
    return ocp.StandardCheckpointer().restore(Path(step_dir) / "params", target)


def _merged_lora_params(meta: dict, cfg, step_dir) -> dict:
    """The base (model.path, WORKDIR/lora_base or the seed's random model) with the adapters merged."""
    from flax import nnx

    from april_jax.models import hf, lora, qwen3

    kind, where = lora.base_source(meta.get("config", {}))
    why = lora.fingerprint_change((meta.get("lora") or {}).get("base"), meta.get("config", {}))
    if why:
        raise CheckpointError(f"{step_dir}: {why}")
    if kind == "path":
        if not Path(where).is_dir():
            raise CheckpointError(f"{step_dir}: the LoRA run's base {where} is gone (export-peft needs no base)")
        base = hf.from_pretrained(where, dtype=cfg.param_dtype)
    else:
        base = qwen3.init_model(cfg, seed=where)
    adapters = restore_adapters(meta, cfg, step_dir)
    return lora.merge(nnx.to_pure_dict(nnx.state(base)), adapters, _lora_config(meta).scale)


def export_peft(path, out, force: bool = False) -> int:
    """Write a LoRA checkpoint's adapters as PEFT's adapter_config.json + adapter_model.safetensors."""
    from safetensors.numpy import save_file

    from april_jax.models import lora, qwen3

    step_dir = resolve_step_dir(path)
    meta = read_meta(step_dir)
    keys = _lora_keys(meta)
    if keys is None:
        raise CheckpointError(f"{step_dir}: a full fine-tuning run (model.lora_rank=0) has no adapters; use export-hf")
    check_export_target(out, force, step_dir)
    cfg = qwen3.Qwen3Config.from_hf_config(
        meta["model_config"], param_dtype=meta["model_config"].get("torch_dtype", "float32")
    )
    tensors = lora.peft_tensors(restore_adapters(meta, cfg, step_dir))
    kind, where = lora.base_source(meta.get("config", {}))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(
        json.dumps(lora.peft_config(keys, where if kind == "path" else ""), indent=2) + "\n"
    )
    return int(meta["step"])


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)


def tokenizer_source(meta: dict):
    """The training run's tokenizer directory (data.tokenizer_path, else model.path), or None."""
    from pathlib import Path

    data, model = meta.get("config", {}).get("data", {}), meta.get("config", {}).get("model", {})
    for path in (data.get("tokenizer_path"), model.get("path")):
        if path and (Path(path) / "tokenizer.json").exists():
            return Path(path)
    return None


def eos_token_id(tokenizer_dir, meta: dict):
    """eos id of the run's tokenizer (its tokenizer_config's eos_token), or the tiny task's."""
    if tokenizer_dir is None:
        if meta.get("config", {}).get("data", {}).get("task") == "reverse":
            from april_jax.data import reverse

            return reverse.EOS
        return None
    from april_jax.data.tokenizer import ChatTokenizer

    tok = ChatTokenizer(tokenizer_dir)
    eos = tok.special.get("eos_token")
    eos = eos["content"] if isinstance(eos, dict) else eos
    return tok.tok.token_to_id(eos) if eos else (tok.stop_ids[0] if tok.stop_ids else None)


def write_tokenizer(tokenizer_dir, out) -> None:
    """Copy the run's tokenizer files beside the weights (AutoTokenizer then loads the export)."""
    import shutil
    from pathlib import Path

    if tokenizer_dir is None:
        print(
            "note: the run has no Hugging Face tokenizer (data.task=reverse or the tokenizer directory "
            "is gone): the export holds weights and config only",
            file=sys.stderr,
        )
        return
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, Path(out) / name)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog=prog("april_jax.cli.ckpt"), description="Inspect and export training checkpoints."
    )
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{inspect,export-hf,export-peft}")
    where = "a workdir, its checkpoints dir, or one step's dir (the latest step when not a step dir)"
    p = sub.add_parser(
        "inspect",
        help="step, policy version, data position, parameters and partial buffer",
        description="Print what a checkpoint holds: step, policy version, data position, skipped "
        "steps, every parameter (shape, dtype, sharding) and the APRIL partial buffer.",
    )
    p.add_argument("path", help=where)
    p.add_argument("--json", action="store_true", help="print it as one JSON object")
    e = sub.add_parser(
        "export-hf",
        help="write a transformers-loadable checkpoint",
        description="Write the checkpoint's weights as a Hugging Face checkpoint (model.safetensors, "
        "config.json with eos_token_id, and the run's tokenizer files).",
    )
    e.add_argument("path", help=where)
    e.add_argument("out", help="output directory: new or empty (see --force)")
    e.add_argument("--force", action="store_true", help="write into a non-empty OUT (replaces its model files)")
    ep = sub.add_parser(
        "export-peft",
        help="write a LoRA run's adapters for PEFT",
        description="Write a LoRA run's adapters as adapter_config.json + adapter_model.safetensors: "
        "peft.PeftModel.from_pretrained(base, OUT) loads them onto the run's base (model.path).",
    )
    ep.add_argument("path", help=where)
    ep.add_argument("out", help="output directory: new or empty (see --force)")
    ep.add_argument("--force", action="store_true", help="write into a non-empty OUT (replaces its adapter files)")
    args = parser.parse_args(argv)
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's missing-metadata warnings are not the user's problem
    try:
        if args.cmd == "inspect":
            info = describe(args.path)
            if args.json:
                print(json.dumps(info, indent=2))
                return
            print(
                f"{info['path']}\n  step {info['step']}  policy version {info['policy_version']}  "
                f"data position {info['data_position']}  skipped steps {info['skipped_steps']}"
            )
            print("  orbax items (read them with plain orbax: README, 'Reading a checkpoint'):")
            for name, how in info["items"].items():
                print(f"    {name:<10} {how}")
            if info["lora"]:
                lo = info["lora"]
                print(
                    f"  LoRA: rank {lo['rank']}  alpha {lo['alpha']}  targets {','.join(lo['targets'])}  "
                    f"(the parameters below are the adapters; the base is the run's model)"
                )
            print(f"  parameters: {info['num_params']:,}")
            for prm in info["params"]:
                print(f"    {prm['name']:<50} {str(tuple(prm['shape'])):<16} {prm['dtype']:<9} {prm['sharding']}")
            b = info["buffer"]
            print(
                f"  partial buffer: {b['groups']} groups ({b['complete_groups']} complete), "
                f"{b['partial_samples']} partial samples, {b['tokens']} tokens; dropped prompts {info['dropped_prompts']}"
            )
        elif args.cmd == "export-peft":
            step = export_peft(args.path, args.out, force=args.force)
            print(f"wrote {args.out} (adapters of step {step} of {resolve_step_dir(args.path).parent.parent})")
        else:
            step = export_hf(args.path, args.out, force=args.force)
            print(f"wrote {args.out} (step {step} of {resolve_step_dir(args.path).parent.parent})")
    except (CheckpointError, FileNotFoundError, NotADirectoryError, PermissionError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
