"""Tokenizer + chat template of a Hugging Face checkpoint directory, without transformers.

Reads `tokenizer.json` (the `tokenizers` library) and the chat template from
`tokenizer_config.json` or `chat_template.jinja`, rendered with jinja2 as transformers does.
Stop ids: the config's eos ids plus the template's end-of-turn tokens when the vocab has them.
"""

from __future__ import annotations

import json
from pathlib import Path

END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


class ChatTokenizer:
    def __init__(self, path, *, system_prompt: str = "", chat: bool = True):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file}: not found (the checkpoint needs a tokenizer.json)")
        self.tok = Tokenizer.from_file(str(file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        self.template = template if chat else None
        self.system_prompt = system_prompt
        self.special = {k: cfg.get(k) for k in ("bos_token", "eos_token")}
        model_cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
        eos = model_cfg.get("eos_token_id")
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        ids |= {self.tok.token_to_id(t) for t in END_OF_TURN if self.tok.token_to_id(t) is not None}
        self.stop_ids = sorted(ids)

    def render(self, prompt: str) -> str:
        if not self.template:
            return prompt
        import jinja2

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        messages.append({"role": "user", "content": prompt})
        special = {k: (v["content"] if isinstance(v, dict) else v) for k, v in self.special.items()}
        return env.from_string(self.template).render(messages=messages, add_generation_prompt=True, **special)

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.tok.encode(self.render(prompt), add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(path, *, system_prompt: str = "", chat: bool = True) -> ChatTokenizer:
    if not path:
        raise FileNotFoundError("model.path is empty: a dataset task needs the checkpoint's tokenizer")
    return ChatTokenizer(path, system_prompt=system_prompt, chat=chat)
