"""The loss mask: with SmolLM2's real tokenizer and template, and with templates that add or strip <think>.

The check is always the same and template-independent: decode each run of trained tokens and compare
with what the model must produce, i.e. the assistant content plus the end-of-turn token.
"""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from eyas.data.chat import ChatEncoder, _common_prefix_len
from eyas.data.readers import BadRow

EOT = "<|im_end|>"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Qwen3-like: the last assistant turn always shows a <think> block (empty if there is no reasoning),
# earlier turns have theirs stripped; `enable_thinking=false` puts an empty block in the generation prompt.
THINK_TEMPLATE = """
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
  {%- set content = message.content -%}
  {%- set reasoning = '' -%}
  {%- if '</think>' in content -%}
    {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
    {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
  {%- endif -%}
  {%- if loop.last -%}
{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
  {%- else -%}
{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
  {%- endif -%}
{%- else -%}
{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}
{%- endif -%}
"""

# DeepSeek-R1-like: reasoning is stripped from every turn, the generation prompt opens a <think> block,
# so the prompt is not a prefix of the rendered conversation.
R1_TEMPLATE = """
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{ '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip() + '<|im_end|>\\n' }}
{%- else -%}
{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}
"""

# Plain-text turns, no special end-of-turn token, and <think> stripped from history.
PLAIN_TEMPLATE = """
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set c = m.content.split('</think>')[-1].lstrip() if not loop.last else m.content -%}
{{ 'Assistant: ' + c + '\\n\\n' }}
{%- else -%}
{{ m.role | capitalize + ': ' + m.content + '\\n\\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ 'Assistant: ' }}{%- endif -%}
"""

# Mistral-like strictness: roles must alternate user/assistant, and no system role.
STRICT_TEMPLATE = """
{%- for m in messages -%}
{%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}
"""


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def trained_runs(tok, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Decoded text of each maximal run of trained tokens."""
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in runs]


def untrained_text(tok, ids: np.ndarray, mask: np.ndarray) -> str:
    return tok.decode(ids[mask == 0].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)


CONVS = {
    "default_system": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": " 4, of course.\n"},
        {"role": "user", "content": "And in French?"},
        {"role": "assistant", "content": "Quatre. Ça fait « quatre » 🙂"},
    ],
    "own_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another, as code:"},
        {"role": "assistant", "content": "```python\nprint(11)\n```"},
    ],
    "tool_turns": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '{"name": "weather", "arguments": {"city": "Paris"}}'},
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "It is 21 °C in Paris."},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVS))
def test_smollm2_mask_is_exactly_the_assistant_replies(tok, name):
    conv = CONVS[name]
    enc = ChatEncoder(tok).encode(conv)
    # the tokens are those of the template's own rendering
    reference = tok.apply_chat_template(conv, tokenize=True, return_dict=False)
    assert enc.input_ids.tolist() == list(reference)
    assert trained_runs(tok, enc.input_ids, enc.loss_mask) == [
        m["content"] + EOT for m in conv if m["role"] == "assistant"]
    context = untrained_text(tok, enc.input_ids, enc.loss_mask)
    for m in conv:
        if m["role"] != "assistant":
            assert m["content"] in context
    assert (DEFAULT_SYSTEM in context) == (conv[0]["role"] != "system")  # injected default prompt: context
    assert not enc.truncated and enc.input_ids.dtype == np.int32 and enc.loss_mask.dtype == np.uint8


def test_think_template_strips_history_and_trains_the_last_block(tok):
    conv = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nfirst I add\n</think>\n\nThe sum is 3."},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "No reasoning here."},
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "<think>\nhmm, 2*3\n</think>\n\nSix."},
    ]
    enc = ChatEncoder(tok, chat_template=THINK_TEMPLATE).encode(conv)
    runs = trained_runs(tok, enc.input_ids, enc.loss_mask)
    assert runs == ["The sum is 3." + EOT, "No reasoning here." + EOT, "<think>\nhmm, 2*3\n</think>\n\nSix." + EOT]
    text = tok.decode(enc.input_ids.tolist(), skip_special_tokens=False)
    assert "first I add" not in text  # stripped from history by the template, so not trained either


def test_think_template_adds_an_empty_block_to_the_last_turn(tok):
    conv = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]  # fmt: skip
    runs = trained_runs(tok, *_ids_mask(ChatEncoder(tok, chat_template=THINK_TEMPLATE).encode(conv)))
    assert runs == ["a1" + EOT, "<think>\n\n</think>\n\na2" + EOT]  # the model must emit the empty block
    # with thinking off, the empty block is part of the prompt: the model only produces the answer
    off = ChatEncoder(tok, chat_template=THINK_TEMPLATE, template_kwargs={"enable_thinking": False}).encode(conv)
    assert trained_runs(tok, *_ids_mask(off)) == ["a1" + EOT, "a2" + EOT]


def test_generation_prompt_that_opens_think_is_not_a_prefix(tok):
    conv = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]  # fmt: skip
    runs = trained_runs(tok, *_ids_mask(ChatEncoder(tok, chat_template=R1_TEMPLATE).encode(conv)))
    assert runs == ["a1" + EOT, "a2" + EOT]


def test_template_without_special_end_token(tok):
    conv = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>r</think> a1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]  # fmt: skip
    enc = ChatEncoder(tok, chat_template=PLAIN_TEMPLATE).encode(conv)
    runs = trained_runs(tok, enc.input_ids, enc.loss_mask)
    assert [r.strip() for r in runs] == ["a1", "a2"]


def test_template_rejection_is_a_counted_skip(tok):
    enc = ChatEncoder(tok, chat_template=STRICT_TEMPLATE)
    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    bad = [{"role": "system", "content": "s"}, *good]
    out = enc.encode_batch([good, bad, good])
    assert isinstance(out[1], BadRow) and out[1].reason == "template_rejects"
    assert "alternate" in out[1].detail
    assert trained_runs(tok, *_ids_mask(out[0])) == ["a" + EOT] and not isinstance(out[2], BadRow)


def test_overlong_truncate_drop_and_nothing_left(tok):
    conv = [{"role": "user", "content": "short question"}, {"role": "assistant", "content": "word " * 200}]
    full = ChatEncoder(tok).encode(conv)
    cut = ChatEncoder(tok, max_length=60).encode(conv)
    assert cut.truncated and len(cut.input_ids) == 60
    np.testing.assert_array_equal(cut.input_ids, full.input_ids[:60])
    np.testing.assert_array_equal(cut.loss_mask, full.loss_mask[:60])
    with pytest.raises(BadRow) as e:
        ChatEncoder(tok, max_length=60, overlong="drop").encode(conv)
    assert e.value.reason == "overlong"
    with pytest.raises(BadRow) as e:
        ChatEncoder(tok, max_length=10).encode(conv)  # the prompt alone is longer
    assert e.value.reason == "no_loss_tokens"


def test_head_only_tokenization_equals_full(tok):
    """Overlong texts are tokenized only up to their head: same ids and mask as tokenizing everything."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "  gamma", "\n\n", "δέλτα", "数据", "🙂", "x=1;", "    "]
    convs = []
    for _ in range(20):
        turns = []
        for _t in range(3):
            turns.append({"role": "user", "content": "".join(rng.choice(words, 20))})
            turns.append({"role": "assistant", "content": " ".join(rng.choice(words, 300))})
        convs.append(turns)
    head = ChatEncoder(tok, max_length=300).encode_batch(convs)
    whole = ChatEncoder(tok).encode_batch(convs)
    for h, w in zip(head, whole, strict=True):
        assert h.truncated
        np.testing.assert_array_equal(h.input_ids, w.input_ids[:300])
        np.testing.assert_array_equal(h.loss_mask, w.loss_mask[:300])


def test_common_prefix_len():
    assert _common_prefix_len("abcdef", "abcxyz") == 3
    assert _common_prefix_len("abc", "abc") == 3
    assert _common_prefix_len("", "abc") == 0
    assert _common_prefix_len("x" * 10_000 + "a", "x" * 10_000 + "b") == 10_000


def _ids_mask(e):
    assert not isinstance(e, BadRow), e
    return e.input_ids, e.loss_mask
