"""Datasets (jsonl/parquet, shuffling, resumable position) and the real Qwen3 tokenizer."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from april_jax import assets
from april_jax.data.dataset import DataError, PromptDataset, read_rows
from april_jax.data.tokenizer import ChatTokenizer, TokenizerError


@pytest.fixture(scope="module")
def qwen():
    return ChatTokenizer(assets.qwen3_tokenizer())


def test_qwen3_tokenizer_matches_known_ids(qwen):
    assert qwen.tok.encode("Hello world").ids == [9707, 1879]
    chat = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    assert qwen.tok.encode(chat).ids == [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]
    assert qwen.tok.encode(" \\boxed{72}").ids == [1124, 79075, 90, 22, 17, 92]
    assert qwen.tok.token_to_id("</think>") == 151668 and qwen.tok.token_to_id("<tool_call>") == 151657
    text = "Natalia sold 48/2 = 24 clips in May. ✓ naïve café 東京"
    assert qwen.decode(qwen.tok.encode(text).ids) == text


def test_qwen3_chat_prompt(qwen):
    assert qwen.render("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert qwen.encode_prompt("hi")[:2] == [151644, 872]
    assert 151645 in qwen.stop_ids and 151643 in qwen.stop_ids


def write_jsonl(path, n):
    path.write_text("".join(json.dumps({"q": f"question {i}", "a": str(i)}) + "\n" for i in range(n)))


def test_dataset_epochs_shuffle_and_resume(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", 5)
    rows = read_rows(str(tmp_path / "d.jsonl"), "q", "a")
    encode = lambda s: [ord(c) for c in s]
    ds = PromptDataset(rows, encode, seed=3)
    first = [next(ds) for _ in range(7)]
    assert sorted(r.answer for r in first[:5]) == [str(i) for i in range(5)]  # one epoch: every row once
    assert [r.uid for r in first[5:]] == ["1:0", "1:1"]
    assert [r.answer for r in first[:5]] != [str(i) for i in range(5)]  # shuffled
    again = PromptDataset(rows, encode, seed=3)
    again.load_state_dict(json.loads(json.dumps(ds.state_dict())))
    cont = PromptDataset(rows, encode, seed=3)
    for _ in range(7):
        next(cont)
    assert [next(again).answer for _ in range(6)] == [next(cont).answer for _ in range(6)]
    assert first[0].source.endswith("d.jsonl:" + str(int(first[0].answer) + 1))


def test_parquet_rows_and_long_prompt_error(tmp_path):
    pq.write_table(pa.table({"prompt": ["a", "bbbbbb"], "answer": [1, 2]}), tmp_path / "d.parquet")
    rows = read_rows(str(tmp_path / "d.parquet"), "prompt", "answer")
    assert rows[1][:2] == ("bbbbbb", "2") and rows[1][2].endswith("d.parquet:row 1")
    encode = lambda s: list(range(len(s)))
    with pytest.raises(DataError, match=r"d.parquet:row 1: prompt has 6 tokens, more than data.max_prompt_len=3"):
        PromptDataset(rows, encode, shuffle=False, max_prompt_len=3)  # up front, not when drawn
    ds = PromptDataset(rows, encode, shuffle=False, max_prompt_len=3, overlong="skip")
    assert [next(ds).prompt_ids for _ in range(2)] == [[0], [0]] and ds.skipped == [rows[1][2]]
    pq.write_table(pa.table({"prompt": [""], "answer": [1]}), tmp_path / "e.parquet")
    with pytest.raises(DataError, match=r"e.parquet:row 0: field 'prompt' must be a non-empty string"):
        read_rows(str(tmp_path / "e.parquet"), "prompt", "answer")


def test_chat_message_rows_from_jsonl_and_parquet(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": messages, "answer": 4, "level": 1}) + "\n")
    pq.write_table(pa.table({"prompt": [messages], "answer": ["4"], "level": [1]}), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.parquet"):
        [(prompt, answer, source, fields)] = read_rows(str(tmp_path / name), "prompt", "answer")
        assert prompt == messages and answer == "4" and fields == {"level": 1}, name
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": [{"role": "user"}], "answer": 1}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: field 'prompt' message 0 must be"):
        read_rows(str(tmp_path / "bad.jsonl"), "prompt", "answer")


def test_chat_messages_render_as_transformers_does():
    import transformers

    path = assets.smollm2_135m_instruct()
    ref = transformers.AutoTokenizer.from_pretrained(path)
    messages = [
        {"role": "system", "content": "You count."},
        {"role": "user", "content": "After 3?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "After 4?"},
    ]
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert ChatTokenizer(path).encode_prompt(messages) == expected
    # data.system_prompt does not replace a row's own system turn
    assert ChatTokenizer(path, system_prompt="Other.").encode_prompt(messages) == expected


def test_qwen3_enable_thinking_false(qwen):
    thinking_off = ChatTokenizer(assets.qwen3_tokenizer(), template_kwargs={"enable_thinking": False})
    messages = [{"role": "user", "content": "hi"}]
    assert thinking_off.render(messages) == qwen.render("hi") + "<think>\n\n</think>\n\n"
    assert thinking_off.encode_prompt("hi")[-4:] == [151667, 271, 151668, 271]


def test_gsm_symbolic_training_problems_are_new_variants_with_computed_answers():
    """The GSM8K config's split: generated training problems never equal a test problem, cover the
    templates, and their answers match an independent formula (the remora template, #473:
    answer = combined remora length / shark length in percent, from the numbers in the text)."""
    import re

    train = [json.loads(l) for l in assets.gsm_symbolic_train().read_text().splitlines()]
    test = [json.loads(l) for l in assets.gsm8k_test_100().read_text().splitlines()]
    assert len(test) == 100 and len(train) >= 900
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert len({r["template"] for r in train}) >= 95
    assert all(re.fullmatch(r"-?[\d.]+", r["answer"]) for r in train)
    remoras = [r for r in train if r["template"] == 473]
    assert len(remoras) >= 5
    for r in remoras:
        feet, count, inches = map(int, re.search(r"a (\d+)-foot \w+ with (\d+) (\d+)-inch", r["prompt"]).groups())
        assert float(r["answer"]) == count * inches / (feet * 12) * 100, r


# A template using what real ones do (Qwen3's: a namespace, reversed iteration, string methods,
# tojson, loop controls; training templates' {% generation %} blocks), written for these tests.
FEATURED_TEMPLATE = """{%- set ns = namespace(last_user=-1) %}
{%- for message in messages[::-1] %}
  {%- if ns.last_user < 0 and message.role == 'user' %}{% set ns.last_user = messages|length - 1 - loop.index0 %}{% endif %}
{%- endfor %}
{%- if tools is defined and tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
  {%- if message.role == 'tool' %}{% continue %}{% endif %}
  {%- set content = message.content %}
  {%- if message.role == 'assistant' and '</think>' in content %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}
<|im_start|>{{ message.role }}{{ ' (last)' if loop.index0 == ns.last_user else '' }}
{% if message.role == 'assistant' %}{% generation %}{{ content.strip() }}{% endgeneration %}{% else %}{{ content | trim }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


def test_templates_render_as_transformers_renders_them(tmp_path):
    """The sandbox gives transformers' text: the shipped SmolLM2 and Qwen3 templates, and one using
    the features real templates use (tojson without HTML escaping, namespace, generation blocks)."""
    import transformers

    messages = [
        {"role": "system", "content": "Be brief. <b>&</b>"},
        {"role": "user", "content": " 2+2? "},
        {"role": "assistant", "content": "<think>\nadd</think>\n\n4"},
        {"role": "tool", "content": "ok"},
        {"role": "user", "content": "and 3+3?"},
    ]
    tools = [{"name": "add", "description": "a < b & c", "parameters": {"a": "int"}}]
    featured = tmp_path / "featured"
    featured.mkdir()
    smol = assets.smollm2_135m_instruct()
    shutil.copy(smol / "tokenizer.json", featured / "tokenizer.json")
    (featured / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": FEATURED_TEMPLATE, "eos_token": "<|im_end|>"})
    )
    for folder, kwargs in [
        (smol, {}),
        (assets.qwen3_tokenizer(), {"enable_thinking": False}),
        (featured, {"enable_thinking": False, "tools": tools}),
        (featured, {}),
    ]:
        ref = transformers.AutoTokenizer.from_pretrained(folder)
        expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        ours = ChatTokenizer(folder, template_kwargs=kwargs).render(messages)
        assert ours == expected, (folder, kwargs)
    assert '"a < b & c"' in ChatTokenizer(featured, template_kwargs={"tools": tools}).render(messages)


@pytest.mark.parametrize(
    "template",
    [
        "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
        "{{ joiner.__init__.__globals__['os'].popen('touch MARKER').read() }}",
        "{{ lipsum.__globals__.os.system('touch MARKER') }}",
        "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch MARKER') }}",
        "{{ (messages | attr('__class__')).__base__.__subclasses__() }}",
        "{{ '{0.__class__.__base__}'.format(messages) }}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{{ dict.__class__ }}",
        "{{ messages.append({'role': 'system', 'content': 'injected'}) }}",
    ],
)
def test_a_template_reaching_past_the_sandbox_fails_naming_its_file_and_runs_nothing(tmp_path, template):
    marker = tmp_path / "ran"
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(assets.smollm2_135m_instruct() / "tokenizer.json", folder / "tokenizer.json")
    (folder / "chat_template.jinja").write_text(template.replace("MARKER", str(marker)))
    tok = ChatTokenizer(folder)
    with pytest.raises(
        TokenizerError,
        match=rf"^{folder / 'chat_template.jinja'}: the chat template tried an "
        r"unsafe operation, refused \(",
    ) as err:
        tok.render("hi")
    assert "\n" not in str(err.value) and not marker.exists()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "hi", "answer": "1"}) + "\n")
    with pytest.raises(DataError, match=rf"^{rows}:1: {folder / 'chat_template.jinja'}: the chat template"):
        PromptDataset(read_rows(str(rows), "prompt", "answer"), tok.encode_prompt, max_prompt_len=64)


def test_a_template_that_does_not_parse_or_fails_is_one_line(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(assets.smollm2_135m_instruct() / "tokenizer.json", folder / "tokenizer.json")
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "{% for m in messages %}{{ m.content }"}))
    with pytest.raises(TokenizerError, match=rf"^{config}: the chat template does not parse \(template line 1: "):
        ChatTokenizer(folder).render("hi")
    config.write_text(json.dumps({"chat_template": "{{ raise_exception('roles must alternate') }}"}))
    with pytest.raises(
        TokenizerError, match=rf"^{config}: the chat template failed \(TemplateError: roles must alternate\)$"
    ):
        ChatTokenizer(folder).render("hi")
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages[0].content }}"}]
    config.write_text(json.dumps({"chat_template": named}))
    assert ChatTokenizer(folder).render("hi") == "Dhi"  # a list of named templates: its default
    config.write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(TokenizerError, match="a list without a 'default' template"):
        ChatTokenizer(folder)


def test_unknown_chat_roles_and_non_regular_files_are_refused(tmp_path):
    messages = [{"role": "wizard", "content": "You are a wizard."}, {"role": "user", "content": "hi"}]
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": messages, "answer": 1}) + "\n")
    with pytest.raises(
        DataError,
        match=r"d.jsonl:1: field 'prompt' message 0 has role 'wizard', expected one of "
        r"system, user, assistant, tool$",
    ):
        read_rows(str(tmp_path / "d.jsonl"), "prompt", "answer")
    import os

    fifo = tmp_path / "eval.jsonl"
    os.mkfifo(fifo)  # reading it would block: refused by its type, unopened
    with pytest.raises(DataError, match=rf"^config key 'data.eval_path'='{fifo}': a FIFO, not a regular file"):
        read_rows(str(fifo), "prompt", "answer", key="data.eval_path")
    with pytest.raises(DataError, match="config key 'data.train_path'='/dev/zero': a device, not a regular file"):
        read_rows("/dev/zero", "prompt", "answer")
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(assets.smollm2_135m_instruct() / "tokenizer.json", folder / "tokenizer.json")
    os.mkfifo(folder / "tokenizer_config.json")
    with pytest.raises(TokenizerError, match=rf"^{folder / 'tokenizer_config.json'}: a FIFO, not a regular file$"):
        ChatTokenizer(folder)
