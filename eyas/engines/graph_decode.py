"""Batched decoding of a transformers causal LM over a static KV cache, each step one CUDA graph.

transformers' `generate` launches every kernel of every layer from Python at each step: for a small
target on a big GPU that is ~100 ms a step at any batch size (docs/benchmarks.md), with the GPU idle.
Here one decode step (attention mask, the model's own forward over a preallocated cache, the choice
of the next token, the stop test) is captured once per call as a CUDA graph and replayed; on a CPU
the same step simply runs in a loop.

What it takes from transformers, all of it public and checked against a plain forward before the
first use (`check_model`), so a version that breaks it fails loudly instead of writing bad text:
- attention layers store keys/values through `past_key_values.update(k, v, layer_idx, ...)` and attend
  over what it returns, with the function `config._attn_implementation` names (AttentionInterface);
- a 4-D boolean attention mask is used as given; `position_ids` and `logits_to_keep` are honoured.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from eyas.utils.devices import run_on_stream
from eyas.utils.io import EyasError

ATTN_NAME = "eyas_grouped"


@dataclass
class Sampler:
    """How the next token is chosen; temperature 0 = greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B]; no host sync (runs inside a CUDA graph)."""
        logits = logits.float()
        if self.temperature == 0:
            return logits.argmax(-1)
        logits = logits / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            drop = sorted_probs.cumsum(-1) - sorted_probs > self.top_p  # keep the smallest prefix reaching top_p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
        probs = logits.softmax(-1)
        return (probs / torch.empty_like(probs).exponential_()).argmax(-1)  # a sample (exponential race)


def grouped_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention with grouped-query heads read in place (SDPA with a mask would copy every cached key
    per query head at every step). query [B, nh, q, hd], key/value [B, g, S, hd], attention_mask
    [B, 1, q, S] bool (True = attend) -> ([B, q, nh, hd], None), transformers' layout."""
    B, nh, q, hd = query.shape
    g, S = key.shape[1], key.shape[2]
    r = nh // g
    scale = hd**-0.5 if scaling is None else scaling
    scores = torch.matmul(query.reshape(B, g, r * q, hd), key.transpose(-1, -2)).float() * scale  # [B, g, r*q, S]
    scores = scores.view(B, g, r, q, S).masked_fill(~attention_mask[:, :, None], float("-inf"))
    probs = scores.softmax(-1).to(value.dtype).view(B, g, r * q, S)
    out = torch.matmul(probs, value).view(B, nh, q, hd)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register_attention() -> None:
    transformers.AttentionInterface.register(ATTN_NAME, grouped_attention)


@contextlib.contextmanager
def _attention_of(model: Any) -> Iterator[None]:
    """The model attends with `grouped_attention` inside the block, with its own function after it."""
    _register_attention()
    before = model.config._attn_implementation
    if not hasattr(model, "set_attn_implementation"):
        raise EyasError("--engine static needs transformers >= 5 (PreTrainedModel.set_attn_implementation); "
                        "use --engine generate")
    model.set_attn_implementation(ATTN_NAME)
    try:
        if model.config._attn_implementation != ATTN_NAME:
            raise EyasError(f"{type(model).__name__} does not let its attention be replaced (transformers' "
                            "AttentionInterface); use --engine generate")
        yield
    finally:
        model.set_attn_implementation(before)


class StaticKV:
    """Keys and values of every layer in preallocated [rows, kv_heads, length, head_dim] buffers.

    New keys go to slots `pos + arange(new)`, `pos` a device tensor the decoder advances, so a
    captured step reads no host value. `rows` selects the rows a prefill chunk writes; `visible`
    (prefill) limits what attention reads to the prompt's slots."""

    def __init__(self, num_layers: int, rows: int, length: int, device: torch.device) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.total_rows, self.length = rows, length
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.rows = slice(None)
        self.visible: int | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer_idx] is None:
            shape = (self.total_rows, key.shape[1], self.length)
            self.k[layer_idx] = key.new_zeros(*shape, key.shape[3])
            self.v[layer_idx] = value.new_zeros(*shape, value.shape[3])
        slots = self.pos + torch.arange(key.shape[2], device=key.device)
        k, v = self.k[layer_idx][self.rows], self.v[layer_idx][self.rows]
        k.index_copy_(2, slots, key)
        v.index_copy_(2, slots, value)
        if self.visible is not None:
            return k[:, :, :self.visible], v[:, :, :self.visible]
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly


def _text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv * hd * dtype.itemsize


class GraphDecoder:
    """Decodes batches of token-id prompts with `model` (a transformers causal LM, eval mode).

    graphs: capture each step as a CUDA graph (default: on CUDA). Prompts of one call are sorted by
    length and decoded in groups whose KV caches (longest prompt + max_new_tokens per row) fit in
    `max_cache_bytes` (default: 60% of free GPU memory; no limit on a CPU).
    """

    def __init__(self, model: Any, graphs: bool | None = None, max_cache_bytes: float | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.max_cache_bytes = max_cache_bytes
        self.config = _text_config(model)
        # a sliding window is not masked here: fine while every sequence fits inside it
        sliding = ("sliding_attention" in (getattr(self.config, "layer_types", None) or [])
                   or getattr(self.config, "use_sliding_window", None) is not False)
        self.window = (getattr(self.config, "sliding_window", None) or 0) if sliding else 0
        self.checked = False

    # -- public ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int,
                 sampler: Sampler | None = None, seed: int = 0) -> list[list[int]]:
        """Replies to `prompts`: new token ids, ending with the stop token where one ended them."""
        sampler = sampler or Sampler()
        if not self.checked:
            self.check_model(prompts[0])
        torch.manual_seed(seed)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a group
        replies: list[list[int]] = [[] for _ in prompts]
        todo = list(self._groups(order, prompts, max_new_tokens))
        while todo:
            group = todo.pop(0)
            try:
                outs = self._generate_group([prompts[i] for i in group], max_new_tokens, stop_ids, pad_id, sampler)
            except torch.OutOfMemoryError:
                if len(group) == 1:
                    raise
                torch.cuda.empty_cache()  # the estimate left too little for activations: halve the group
                todo[:0] = [group[: len(group) // 2], group[len(group) // 2:]]
                continue
            for i, o in zip(group, outs, strict=True):
                replies[i] = o
        return replies

    @torch.inference_mode()
    def check_model(self, prompt: list[int], steps: int = 3) -> None:
        """Compare our prefill and decode steps' logits with a plain forward of the model on the same
        tokens (one row left-padded, one not); raise when transformers' internals broke the contract."""
        prompt = prompt[-64:] if len(prompt) > 1 else prompt * 2
        rows = [prompt, prompt[len(prompt) // 2:]]
        seen: list[torch.Tensor] = []
        what = f"--engine static with {type(self.model).__name__} and transformers {transformers.__version__}"
        try:
            out = self._generate_group(rows, steps + 1, [], 0, Sampler(), graphs=False, record=seen)
        except (TypeError, ValueError, RuntimeError, AttributeError) as e:
            raise EyasError(f"{what} failed ({type(e).__name__}: {str(e)[:200]}); use --engine generate") from e
        worst = 0.0
        for r, row in enumerate(rows):
            seq = torch.tensor([row + out[r][:steps]], device=self.device)
            ref = self.model(input_ids=seq).logits[0, len(row) - 1:].float()  # [steps+1, V]
            got = torch.stack([s[r] for s in seen]).float()
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item())
        tol = 1e-3 if self.dtype == torch.float32 else 6e-2
        if not worst <= tol:
            raise EyasError(f"{what}: logits over the static cache differ from a plain forward (max rel err "
                            f"{worst:.2e} > {tol:.0e}); use --engine generate")
        self.checked = True

    # -- internals ---------------------------------------------------------------------------------

    def _groups(self, order: list[int], prompts: list[list[int]], max_new: int) -> Iterator[list[int]]:
        """Consecutive runs of `order` (ascending lengths) whose caches fit in the memory budget. (A step's
        fixed cost, ~600 small kernels, outweighs reading the padded cache: big groups win.)"""
        per_token = _kv_bytes_per_token(self.config, self.dtype)
        budget = self.max_cache_bytes
        if budget is None:
            budget = torch.cuda.mem_get_info(self.device)[0] * 0.6 if self.device.type == "cuda" else float("inf")
        group: list[int] = []
        for i in order:
            length = len(prompts[i]) + max_new  # the longest so far: it sets the group's cache length
            if group and (len(group) + 1) * length * per_token > budget:
                yield group
                group = []
            group.append(i)
        if group:
            yield group

    def _generate_group(self, prompts: list[list[int]], max_new: int, stop_ids: list[int], pad_id: int,
                        sampler: Sampler, graphs: bool | None = None,
                        record: list[torch.Tensor] | None = None) -> list[list[int]]:
        dev = self.device
        n, P = len(prompts), max(len(p) for p in prompts)
        L = P + max_new
        if self.window and self.window < L:
            raise EyasError(f"{type(self.model).__name__} has sliding-window attention ({self.window} tokens), which "
                            f"--engine static does not mask, and a sequence here reaches {L}; use --engine generate")
        ids = torch.full((n, P), pad_id, dtype=torch.long)
        lens = torch.tensor([len(p) for p in prompts])
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        slot = torch.arange(L)
        valid = (slot[None, :] >= (P - lens)[:, None]).to(dev)  # [n, L]: not left padding
        positions = (torch.arange(P)[None, :] - (P - lens)[:, None]).clamp_min(0)  # [n, P]
        cache = StaticKV(self.config.num_hidden_layers, n, L, dev)
        stops = torch.tensor(stop_ids or [-1], dtype=torch.long, device=dev)
        out = torch.full((n, max_new), pad_id, dtype=torch.long, device=dev)
        with _attention_of(self.model):
            first = self._prefill(ids, positions, valid, cache, sampler, record)  # [n]
            out[:, 0] = first
            state = _DecodeState(tok=first[:, None].clone(), pos=lens.to(dev)[:, None].clone(), valid=valid,
                                 slots=slot.to(dev), done=torch.isin(first, stops),
                                 step=torch.ones(1, dtype=torch.long, device=dev), out=out, stops=stops, pad=pad_id)
            cache.pos.fill_(P)
            step = functools.partial(self._step, state, cache, sampler, record)
            self._decode(step, max_new - 1, state.done, self.graphs if graphs is None else graphs)
        rows = out.tolist()
        stop = set(stop_ids)
        return [r[:next((t + 1 for t, x in enumerate(r) if x in stop), len(r))] for r in rows]

    def _prefill(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: StaticKV,
                 sampler: Sampler, record: list[torch.Tensor] | None) -> torch.Tensor:
        """Fill the cache with the prompts (in row chunks: scores are [rows, heads, P, P] floats) and
        choose each row's first token."""
        n, P = ids.shape
        heads = self.config.num_attention_heads
        rows = max(1, min(n, (1 << 30) // (heads * P * P * 4), max(1, 65536 // P)))
        causal = torch.ones(P, P, dtype=torch.bool, device=self.device).tril()
        cache.visible = P
        firsts, chunks = [], []
        for a in range(0, n, rows):
            b = min(n, a + rows)
            cache.rows = slice(a, b)
            v = valid[a:b, :P]
            mask = (causal[None] & v[:, None, :]) | torch.eye(P, dtype=torch.bool, device=self.device)[None]
            logits = self.model(input_ids=ids[a:b].to(self.device), position_ids=positions[a:b].to(self.device),
                                attention_mask=mask[:, None], past_key_values=cache, use_cache=True,
                                logits_to_keep=1).logits[:, -1]  # [rows, V]
            firsts.append(sampler(logits))
            if record is not None:
                chunks.append(logits)
        cache.rows, cache.visible = slice(None), None
        if record is not None:
            record.append(torch.cat(chunks))
        return torch.cat(firsts)

    def _step(self, s: _DecodeState, cache: StaticKV, sampler: Sampler,
              record: list[torch.Tensor] | None) -> None:
        """One token for every row: all state lives in device tensors, so this can be graph-captured."""
        mask = s.valid & (s.slots <= cache.pos)  # [n, L]: what the new token may attend to
        logits = self.model(input_ids=s.tok, position_ids=s.pos, attention_mask=mask[:, None, None, :],
                            past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # [n, V]
        if record is not None:
            record.append(logits)
        nxt = torch.where(s.done, s.pad, sampler(logits))
        s.out.index_copy_(1, s.step, nxt[:, None])
        s.done |= torch.isin(nxt, s.stops)
        s.tok.copy_(nxt[:, None])
        s.pos.add_(1)
        cache.pos.add_(1)
        s.step.add_(1)

    def _decode(self, step: Any, count: int, done: torch.Tensor, graphs: bool) -> None:
        """Run `step` `count` times (as a replayed CUDA graph when asked), stopping early once every
        row is done (checked every 16 steps: the only host syncs)."""
        run, i = step, 0
        if graphs and count > 3:
            side = torch.cuda.Stream(self.device)
            try:
                for _ in range(2):  # warm up (real steps) outside the capture
                    run_on_stream(side, step)
                i = 2
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                run = graph.replay
            except RuntimeError as e:  # an op that cannot be captured: decode step by step
                warnings.warn(f"CUDA graph capture failed ({str(e)[:160]}); decoding without graphs", stacklevel=2)
                self.graphs = False
        while i < count:
            run()
            i += 1
            if i % 16 == 0 and bool(done.all()):
                break


@dataclass
class _DecodeState:
    tok: torch.Tensor  # [n, 1] last token of each row
    pos: torch.Tensor  # [n, 1] its rotary position
    valid: torch.Tensor  # [n, L] cache slots that are not left padding
    slots: torch.Tensor  # [L] 0..L-1
    done: torch.Tensor  # [n] bool: a stop token was produced
    step: torch.Tensor  # [1] next column of `out`
    out: torch.Tensor  # [n, max_new] chosen tokens (pad after a stop)
    stops: torch.Tensor  # [k] stop ids
    pad: int
