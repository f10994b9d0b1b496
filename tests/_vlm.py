"""Tiny Qwen2.5-VL and Gemma3 (vision) targets for the image tests, built offline: a byte-level
tokenizer with the family's special tokens, a chat template in its style, a PIL image processor and
a random model, saved as a folder `eyas prepare` and the engines load."""

from __future__ import annotations

from pathlib import Path

import torch
from _kimi import byte_tokenizer, no_video_processor

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
QWEN_TEMPLATE = r"""
{%- for m in messages -%}
<|im_start|>{{ m.role }}
{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}
{%- if p.type == 'text' %}{{ p.text }}{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}
{%- endfor %}{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""

GEMMA_SPECIALS = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                  "<image_soft_token>"]
GEMMA_TEMPLATE = r"""<bos>
{%- for m in messages -%}
<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}
{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}
{%- if p.type == 'text' %}{{ p.text }}{% else %}<start_of_image>{% endif %}
{%- endfor %}{% endif %}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt %}<start_of_turn>model
{% endif -%}
"""
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048)


def qwen25vl_processor(folder: str | Path):
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    image = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    return Qwen2_5_VLProcessor(image_processor=image, tokenizer=AutoTokenizer.from_pretrained(folder),
                               video_processor=no_video_processor())


def make_qwen25vl(out: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    tok = byte_tokenizer(QWEN_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = QWEN_TEMPLATE
    ids = {s: tok.convert_tokens_to_ids(s) for s in QWEN_SPECIALS}
    text = dict(TEXT, vocab_size=len(tok), bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                                num_heads=2, out_hidden_size=64,
                                                                fullatt_block_indexes=[0], window_size=56),
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(cfg).float().save_pretrained(out)
    tok.save_pretrained(out)
    return Path(out)


def make_gemma3(out: Path, seed: int = 0) -> Path:
    """Gemma3 with a PIL image processor saved in the folder: transformers' AutoProcessor loads it as it is."""
    from transformers import AutoModelForImageTextToText, Gemma3Config, Gemma3ImageProcessorPil, Gemma3Processor

    tok = byte_tokenizer(GEMMA_SPECIALS, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                         extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                               "image_token": "<image_soft_token>"})
    tok.chat_template = GEMMA_TEMPLATE
    text = dict(TEXT, vocab_size=len(tok), head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = Gemma3Config(text_config=text, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                            num_attention_heads=2, image_size=56, patch_size=14,
                                                            vision_use_head=False),
                       mm_tokens_per_image=4, boi_token_index=tok.boi_token_id, image_token_index=tok.image_token_id,
                       eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"))
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(cfg).float().save_pretrained(out)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
                                tokenizer=tok, image_seq_length=4)
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    return Path(out)
