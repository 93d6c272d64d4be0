"""Tokenizer + chat template of a Hugging Face checkpoint directory, without transformers.

Reads `tokenizer.json` (the `tokenizers` library) and the chat template from
`tokenizer_config.json` or `chat_template.jinja`, rendered with jinja2 as transformers does.
Stop ids: the config's eos ids plus the template's end-of-turn tokens when the vocab has them.
A prompt is a string (one user turn) or a list of chat messages; `template_kwargs` reach the
template as variables (Qwen3's `enable_thinking=False`), as transformers' `apply_chat_template` does.
"""

from __future__ import annotations

import json
from pathlib import Path

END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


class TokenizerError(ValueError):
    """A malformed tokenizer file; the message names it."""


def _read_json(file: Path) -> dict:
    try:
        out = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{file}: invalid JSON ({e})") from None
    if not isinstance(out, dict):
        raise TokenizerError(f"{file}: expected a JSON object")
    return out


class ChatTokenizer:
    def __init__(self, path, *, system_prompt: str = "", chat: bool = True, template_kwargs: dict | None = None):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file}: not found (the checkpoint needs a tokenizer.json)")
        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
            raise TokenizerError(f"{file}: not a readable tokenizer ({str(e).splitlines()[0][:200]})") from None
        cfg_file = path / "tokenizer_config.json"
        cfg = _read_json(cfg_file) if cfg_file.exists() else {}
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        self.template = template if chat else None
        self.system_prompt = system_prompt
        self.template_kwargs = dict(template_kwargs or {})
        self.special = {k: cfg.get(k) for k in ("bos_token", "eos_token")}
        model_cfg = _read_json(path / "config.json") if (path / "config.json").exists() else {}
        eos = model_cfg.get("eos_token_id")
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        ids |= {self.tok.token_to_id(t) for t in END_OF_TURN if self.tok.token_to_id(t) is not None}
        self.stop_ids = sorted(ids)

    def render(self, prompt: str | list[dict]) -> str:
        """The prompt text the model sees: the chat template applied with a generation prompt."""
        if not self.template:
            if isinstance(prompt, str):
                return prompt
            raise ValueError("a prompt given as chat messages needs a chat template (data.chat_template=true "
                             "and a tokenizer_config.json or chat_template.jinja with one)")
        import jinja2

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt and messages[0]["role"] != "system":  # the row's own system turn wins
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        special = {k: (v["content"] if isinstance(v, dict) else v) for k, v in self.special.items()}
        return env.from_string(self.template).render(messages=messages, add_generation_prompt=True,
                                                     **{**special, **self.template_kwargs})

    def encode_prompt(self, prompt: str | list[dict]) -> list[int]:
        return self.tok.encode(self.render(prompt), add_special_tokens=False).ids

    @property
    def vocab_size(self) -> int:
        """Token ids run below this (added tokens included): the model's embedding must be at least as large."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(path, *, system_prompt: str = "", chat: bool = True,
                   template_kwargs: dict | None = None) -> ChatTokenizer:
    if not path:
        raise FileNotFoundError("model.path is empty: a dataset task needs the checkpoint's tokenizer")
    return ChatTokenizer(path, system_prompt=system_prompt, chat=chat, template_kwargs=template_kwargs)
