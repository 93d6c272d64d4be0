"""Tokenizer + chat template of a Hugging Face checkpoint directory, without transformers.

Reads `tokenizer.json` (the `tokenizers` library) and the chat template from
`tokenizer_config.json` or `chat_template.jinja`. A template is code that came with a download, so
it renders in jinja2's immutable sandbox with the globals and filters transformers gives it (the
same text as `apply_chat_template`); one that reaches for Python internals fails with a
TokenizerError naming its file, and nothing it asked for runs.
Stop ids: the config's eos ids plus the template's end-of-turn tokens when the vocab has them.
A prompt is a string (one user turn) or a list of chat messages; `template_kwargs` reach the
template as variables (Qwen3's `enable_thinking=False`), as transformers' `apply_chat_template` does.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")
# older jinja2 releases have known sandbox escapes (transformers refuses them for the same reason)
SAFE_JINJA2 = (3, 1, 6)


class TokenizerError(ValueError):
    """A malformed tokenizer file, or a chat template that does not parse, fails or is refused;
    the message names the file."""


def check_regular_file(file: Path) -> None:
    from april_jax.data.dataset import irregular_kind

    kind = irregular_kind(file)
    if kind:
        raise TokenizerError(f"{file}: {kind}, not a regular file")


def _read_json(file: Path) -> dict:
    check_regular_file(file)
    try:
        out = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{file}: invalid JSON ({e})") from None
    if not isinstance(out, dict):
        raise TokenizerError(f"{file}: expected a JSON object")
    return out


def _jinja2_version() -> tuple[int, ...]:
    import jinja2

    return tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())


def sandbox():
    """The jinja2 environment chat templates render in: transformers' (`_compile_jinja_template`),
    so a template gives the same text here: an immutable sandbox (no attribute starting with `_`,
    no mutating method of a list or dict; reaching for one fails at once), its `tojson` (no HTML escaping), `raise_exception`,
    `strftime_now`, a `namespace` that refuses underscore names, and `{% generation %}` blocks."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        rendering a prompt needs only its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class GuardedNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # jinja's own signature trick: `namespace(self=...)` still works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                GuardedNamespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            GuardedNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)`, without the class itself to climb from."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class StrictSandbox(ImmutableSandboxedEnvironment):
        """Refuses an unsafe attribute when it is reached, not only when it is used: jinja2 hands
        back an Undefined that prints as '', so a probe would otherwise pass unnoticed."""

        def unsafe_undefined(self, obj, attribute):
            raise jinja2.exceptions.SecurityError(
                f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
            )

    env = StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=TemplateDict(),
        namespace=GuardedNamespace,
    )
    return env


def _template_text(value, source: str) -> str:
    """A chat template as text: a string, or the "default" of a list of named templates."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
        if value is None:
            raise TokenizerError(
                f"{source}: chat_template is a list without a 'default' template (names: {sorted(map(str, named))})"
            )
    if not isinstance(value, str):
        raise TokenizerError(f"{source}: chat_template must be a string, got {type(value).__name__}")
    return value


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


class ChatTokenizer:
    def __init__(self, path, *, system_prompt: str = "", chat: bool = True, template_kwargs: dict | None = None):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file}: not found (the checkpoint needs a tokenizer.json)")
        check_regular_file(file)
        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
            raise TokenizerError(f"{file}: not a readable tokenizer ({str(e).splitlines()[0][:200]})") from None
        cfg_file = path / "tokenizer_config.json"
        cfg = _read_json(cfg_file) if cfg_file.exists() else {}
        template, self.template_source = cfg.get("chat_template"), str(cfg_file)
        if template is None and (path / "chat_template.jinja").exists():
            jinja_file = path / "chat_template.jinja"
            check_regular_file(jinja_file)
            template, self.template_source = jinja_file.read_text(), str(jinja_file)
        self.template = _template_text(template, self.template_source) if chat and template is not None else None
        self._compiled = None  # on first render: `ckpt` reads this folder for its eos id alone
        self.system_prompt = system_prompt
        self.template_kwargs = dict(template_kwargs or {})
        self.special = {k: cfg.get(k) for k in ("bos_token", "eos_token")}
        model_cfg = _read_json(path / "config.json") if (path / "config.json").exists() else {}
        eos = model_cfg.get("eos_token_id")
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        ids |= {self.tok.token_to_id(t) for t in END_OF_TURN if self.tok.token_to_id(t) is not None}
        self.stop_ids = sorted(ids)

    def _compile(self, template: str):
        import jinja2

        if _jinja2_version() < SAFE_JINJA2:
            raise TokenizerError(
                f"{self.template_source}: rendering a chat template safely needs jinja2 >= "
                f"{'.'.join(map(str, SAFE_JINJA2))}, found {jinja2.__version__} (pip install -U jinja2)"
            )
        try:
            return sandbox().from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise TokenizerError(
                f"{self.template_source}: the chat template does not parse (template line {e.lineno}: {e.message})"
            ) from None

    def render(self, prompt: str | list[dict]) -> str:
        """The prompt text the model sees: the chat template applied with a generation prompt."""
        if not self.template:
            if isinstance(prompt, str):
                return prompt
            raise TokenizerError(
                "a prompt given as chat messages needs a chat template (data.chat_template=true "
                "and a tokenizer_config.json or chat_template.jinja with one)"
            )
        import jinja2

        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt and messages[0]["role"] != "system":  # the row's own system turn wins
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        special = {k: (v["content"] if isinstance(v, dict) else v) for k, v in self.special.items()}
        if self._compiled is None:
            self._compiled = self._compile(self.template)
        try:
            return self._compiled.render(
                messages=messages, add_generation_prompt=True, **{**special, **self.template_kwargs}
            )
        except jinja2.exceptions.SecurityError as e:
            raise TokenizerError(
                f"{self.template_source}: the chat template tried an unsafe operation, refused ({_first_line(e)})"
            ) from None
        except Exception as e:  # the template's own raise_exception, or a bug in it: its text, one line
            raise TokenizerError(
                f"{self.template_source}: the chat template failed ({type(e).__name__}: {_first_line(e)})"
            ) from None

    def encode_prompt(self, prompt: str | list[dict]) -> list[int]:
        return self.tok.encode(self.render(prompt), add_special_tokens=False).ids

    @property
    def vocab_size(self) -> int:
        """Token ids run below this (added tokens included): the model's embedding must be at least as large."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(
    path, *, system_prompt: str = "", chat: bool = True, template_kwargs: dict | None = None
) -> ChatTokenizer:
    if not path:
        raise FileNotFoundError("model.path is empty: a dataset task needs the checkpoint's tokenizer")
    return ChatTokenizer(path, system_prompt=system_prompt, chat=chat, template_kwargs=template_kwargs)
