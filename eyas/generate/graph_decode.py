"""Continuous batching of a transformers causal LM over static KV caches, each decode step one CUDA graph.

transformers' `generate` launches every kernel of every layer from Python at each step: for a small
target on a big GPU the step time is launch-bound at any batch size (docs/benchmarks.md), the GPU idle.
Here the decoder owns fixed "rows" (sequence slots) in a few *lanes*, each lane one preallocated KV
cache of one length (e.g. 512, 1,024 and 2,048 tokens). A request (a prompt) takes a free row of the
shortest lane it fits in, is prefilled there (causal SDPA over the prompt alone), and decodes until it
stops; its row is then given to the next waiting request, so a long reply never holds up short ones
(the old round-by-round scheme waited for each round's longest reply). One decode step of a lane (mask,
the model's own forward over the cache, the choice of the next token, the stop test) is captured once
per attended width as a CUDA graph and replayed; on a CPU the same step simply runs in a loop. Short
lanes cost less memory per row and each lane attends only as far as its longest live row reaches, so
the memory-bound attention reads little padding.

What it takes from transformers, all of it public and checked against a plain forward before the
first use (`check_model`), so a version that breaks it fails loudly instead of writing bad text:
- attention layers store keys/values through `past_key_values.update(k, v, layer_idx, ...)` and attend
  over what it returns, with the function `config._attn_implementation` names (AttentionInterface);
- a 4-D boolean attention mask is used as given, and none is built for a custom attention function;
- `position_ids` and `logits_to_keep` are honoured; `get_decoder()` / `get_output_embeddings()` split
  the model into its body and its head.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from eyas.model.config import text_config
from eyas.utils.devices import run_on_stream
from eyas.utils.io import EyasError

ATTN_NAME = "eyas_grouped"
PREFILL_TOKENS = 32768  # padded prompt tokens per prefill forward


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
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Prefill (no mask, several queries): causal SDPA over the prompt's own keys, which are right-padded
    so padding never precedes a real token. Decode (one query, mask [B, 1, 1, S] bool, True = attend):
    grouped-query heads read the cache in place (SDPA with a mask would copy every cached key per query
    head at every step). query [B, nh, q, hd], key/value [B, g, S, hd] -> ([B, q, nh, hd], None)."""
    B, nh, q, hd = query.shape
    g, S = key.shape[1], key.shape[2]
    scale = hd**-0.5 if scaling is None else scaling
    if attention_mask is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=g != nh)
        return out.transpose(1, 2).contiguous(), None
    r = nh // g
    scores = torch.matmul(query.reshape(B, g, r * q, hd), key.transpose(-1, -2)).float() * scale  # [B, g, r*q, S]
    scores = scores.view(B, g, r, q, S).masked_fill(~attention_mask[:, :, None], float("-inf"))
    probs = scores.softmax(-1).to(value.dtype).view(B, g, r * q, S)
    out = torch.matmul(probs, value).view(B, nh, q, value.shape[-1])  # MLA: values narrower than queries
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register_attention() -> None:
    transformers.AttentionInterface.register(ATTN_NAME, grouped_attention)


@contextlib.contextmanager
def attention_of(model: Any) -> Iterator[None]:
    """The model attends with `grouped_attention` inside the block, with its own function after it."""
    _register_attention()
    before = model.config._attn_implementation
    if not hasattr(model, "set_attn_implementation"):
        raise EyasError("decoding over static KV caches needs transformers >= 5 "
                        "(PreTrainedModel.set_attn_implementation)")
    model.set_attn_implementation(ATTN_NAME)
    try:
        if model.config._attn_implementation != ATTN_NAME:
            raise EyasError(f"{type(model).__name__} does not let its attention be replaced (transformers' "
                            "AttentionInterface), which decoding over static KV caches needs")
        yield
    finally:
        model.set_attn_implementation(before)


class Lane:
    """`rows` sequences of up to `length` tokens: their KV cache, decode state and graphs.

    The lane is also the `past_key_values` the model writes through. In prefill (`prefill_rows` set) the
    prompt's keys go to slots 0..P-1 of those rows and attention sees the prompt alone; in decode the
    first `n` rows step (requests take the lowest free rows, so idle rows past them cost nothing), each
    row's new key goes to slot `pos[row]` (or, with `write` [n, T] set, its T new keys to those slots:
    a speculative decoder's verify forward) and attention reads the first `width` slots. All decode state
    lives in device tensors at fixed addresses, so a captured step reads no host value."""

    def __init__(self, num_layers: int, rows: int, length: int, max_new: int, stops: torch.Tensor,
                 pad_id: int) -> None:
        device = stops.device
        self.rows, self.length, self.max_new, self.stops = rows, length, max_new, stops
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.prefill_rows: torch.Tensor | None = None
        self.write: torch.Tensor | None = None
        self.width, self.n = length, rows
        self.tok = torch.zeros(rows, 1, dtype=torch.long, device=device)  # last token of each row
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=device)  # its slot = its rotary position
        self.count = torch.zeros(rows, dtype=torch.long, device=device)  # tokens chosen so far
        self.done = torch.ones(rows, dtype=torch.bool, device=device)  # stopped, or no request
        self.out = torch.full((rows, max_new + 1), pad_id, dtype=torch.long, device=device)  # last column: scratch
        self.slots = torch.arange(length, device=device)
        # host side: the request in each row and how far its row can have reached (prompt + steps run)
        self.keys: list[Hashable | None] = [None] * rows
        self.reach = [0] * rows

    def free_rows(self) -> list[int]:
        return [r for r, k in enumerate(self.keys) if k is None]

    def busy(self) -> bool:
        return any(k is not None for k in self.keys)

    # -- the cache contract transformers' attention layers use ------------------------------------

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer_idx] is None:
            # allocated at the first write, in the shapes the layer caches (MLA: a latent, not per-head keys)
            self.k[layer_idx] = key.new_zeros(self.rows, key.shape[1], self.length, key.shape[3])
            self.v[layer_idx] = value.new_zeros(self.rows, value.shape[1], self.length, value.shape[3])
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self.prefill_rows is not None:
            P = key.shape[2]
            k[self.prefill_rows, :, :P] = key
            v[self.prefill_rows, :, :P] = value
            return key, value
        k, v = k[:self.n], v[:self.n]
        slots = self.pos[:self.n] if self.write is None else self.write
        # keys and values may differ in heads and width (MLA caches a latent and a rotary key in their place)
        k.scatter_(2, slots[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3]), key)
        v.scatter_(2, slots[:, None, :, None].expand(-1, value.shape[1], -1, value.shape[3]), value)
        return k[:, :, :self.width], v[:, :, :self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly


def _kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv * hd * dtype.itemsize


class GraphDecoder:
    """Continuous batching of token-id prompts through `model` (a transformers causal LM, eval mode).

    `submit` queues a prompt, `poll` decodes until some requests finish and returns them; `generate`
    does both for a list. Every prompt + `max_new_tokens` must fit in `max_length`.

    lanes: [(length, rows), ...]; default: lengths max_length/4, /2 and max_length (those longer than a
    reply) sharing `max_cache_bytes` (default 60% of free GPU memory) 15/35/50, or one lane of 16 rows
    on a CPU. graphs: capture each decode step as a CUDA graph (default: on CUDA). steps_per_poll:
    decode steps between looks at which rows finished (the only host syncs; on a GPU a second batch of
    steps is queued before the look, so the GPU keeps working while the host reads and tokenizes).
    """

    def __init__(self, model: Any, max_length: int, max_new_tokens: int, stop_ids: list[int], pad_id: int,
                 sampler: Sampler | None = None, lanes: list[tuple[int, int]] | None = None,
                 graphs: bool | None = None, max_cache_bytes: float | None = None, steps_per_poll: int = 8) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.config = text_config(model.config)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.max_length, self.max_new, self.pad_id = max_length, max_new_tokens, pad_id
        self.sampler = sampler or Sampler()
        self.stops = torch.tensor(stop_ids or [-1], dtype=torch.long, device=self.device)
        self.steps_per_poll = steps_per_poll
        # a sliding window is not masked here: fine while every sequence fits inside it
        sliding = ("sliding_attention" in (getattr(self.config, "layer_types", None) or [])
                   or getattr(self.config, "use_sliding_window", None) is not False)
        self.window = (getattr(self.config, "sliding_window", None) or 0) if sliding else 0
        if self.window and self.window < max_length:
            raise EyasError(f"{type(model).__name__} has sliding-window attention ({self.window} tokens), which "
                            f"decoding over static KV caches does not mask, and sequences here reach {max_length} "
                            "tokens")
        self.lane_shapes = sorted(lanes or self._default_lanes(max_cache_bytes))
        if not self.lane_shapes or self.lane_shapes[-1][0] < max_length or min(r for _, r in self.lane_shapes) < 1:
            raise EyasError(f"lanes {self.lane_shapes} must include one of length >= {max_length}, each with rows")
        self.lanes: list[Lane] = []
        self.queue: list[tuple[int, int, Hashable, list[int]]] = []  # (rank, submission number, key, prompt)
        self.submitted = 0
        self.checked = False
        self.step_graphs = StepGraphs(self.device, self.graphs)

    @property
    def capacity(self) -> int:
        return sum(rows for _, rows in self.lane_shapes)

    def _default_lanes(self, budget: float | None) -> list[tuple[int, int]]:
        if budget is None and self.device.type != "cuda":
            return [(self.max_length, 16)]
        if budget is None:
            budget = torch.cuda.mem_get_info(self.device)[0] * 0.6
        per_token = _kv_bytes_per_token(self.config, self.dtype)
        lengths = [n for n in (self.max_length // 4, self.max_length // 2) if n > self.max_new] + [self.max_length]
        shares = {1: [1.0], 2: [0.4, 0.6], 3: [0.15, 0.35, 0.5]}[len(lengths)]
        return [(n, max(1, int(budget * s // (n * per_token)))) for n, s in zip(lengths, shares, strict=True)]

    # -- public ----------------------------------------------------------------------------------

    def submit(self, key: Hashable, prompt: list[int], rank: int | None = None) -> None:
        """Queue `prompt` (token ids); its reply comes back from `poll` under `key`. Waiting prompts take
        free rows lowest `rank` first (default: the order of submission)."""
        if not prompt or len(prompt) + self.max_new > self.max_length:
            raise EyasError(f"a prompt of {len(prompt)} tokens + {self.max_new} new ones does not fit in "
                            f"max_length {self.max_length}")
        self.queue.append((self.submitted if rank is None else rank, self.submitted, key, prompt))
        self.submitted += 1

    def busy(self) -> bool:
        return bool(self.queue) or any(lane.busy() for lane in self.lanes)

    @torch.inference_mode()
    def poll(self) -> list[tuple[Hashable, list[int]]]:
        """Admit waiting prompts to free rows, decode, and return the requests that finished: (key, new
        token ids ending with the stop token where one ended them)."""
        if not self.checked:
            self.check_model(self.queue[0][3] if self.queue else [0, 1])
        if not self.lanes:
            self.lanes = [Lane(self.config.num_hidden_layers, rows, n, self.max_new, self.stops, self.pad_id)
                          for n, rows in self.lane_shapes]
        with attention_of(self.model):
            self._admit()
            live = [lane for lane in self.lanes if lane.busy()]
            if not live:
                return []
            self._run(live, self.steps_per_poll)
            cuda = self.device.type == "cuda"
            seen = [(lane.done.to("cpu", non_blocking=cuda), lane.count.to("cpu", non_blocking=cuda),
                     lane.out.to("cpu", non_blocking=cuda)) for lane in live]
            if cuda:
                ready = torch.cuda.Event()
                ready.record()
                self._run(live, self.steps_per_poll)  # keeps the GPU busy while the host looks and works
                ready.synchronize()
        finished = []
        for lane, (done, count, out) in zip(live, seen, strict=True):
            for r in done.nonzero().flatten().tolist():
                if lane.keys[r] is not None:
                    finished.append((lane.keys[r], out[r, :int(count[r])].tolist()))
                    lane.keys[r] = None
        return finished

    def generate(self, prompts: list[list[int]], seed: int = 0) -> list[list[int]]:
        """Replies to `prompts` (see `poll`), in order."""
        torch.manual_seed(seed)
        for i, p in enumerate(prompts):
            self.submit(i, p)
        replies: list[list[int]] = [[] for _ in prompts]
        while self.busy():
            for i, toks in self.poll():
                replies[i] = toks
        return replies

    @torch.inference_mode()
    def check_model(self, prompt: list[int], steps: int = 3) -> None:
        """Compare our prefill and decode steps' logits with a plain forward of the model on the same
        tokens (two rows of different lengths); raise when transformers' internals broke the contract."""
        prompt = prompt[-64:] if len(prompt) > 1 else prompt * 2
        rows = [prompt, prompt[len(prompt) // 2:]]
        no_stop = torch.tensor([-1], device=self.device)
        lane = Lane(self.config.num_hidden_layers, 2, len(prompt) + steps + 1, steps + 1, no_stop, self.pad_id)
        seen: list[torch.Tensor] = []
        what = f"decoding over static KV caches with {type(self.model).__name__} and transformers " \
               f"{transformers.__version__}"
        try:
            with attention_of(self.model):
                self._prefill(lane, [0, 1], rows, record=seen)
                for _ in range(steps):
                    self._step(lane, record=seen)
        except (TypeError, ValueError, RuntimeError, AttributeError) as e:
            raise EyasError(f"{what} failed ({type(e).__name__}: {str(e)[:200]})") from e
        out = lane.out.tolist()
        worst = 0.0
        for r, row in enumerate(rows):
            seq = torch.tensor([row + out[r][:steps]], device=self.device)
            ref = self.model(input_ids=seq).logits[0, len(row) - 1:].float()  # [steps+1, V]
            got = torch.stack([s[r] for s in seen]).float()
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item())
        tol = 1e-3 if self.dtype == torch.float32 else 6e-2
        if not worst <= tol:
            raise EyasError(f"{what}: logits over the static cache differ from a plain forward (max rel err "
                            f"{worst:.2e} > {tol:.0e})")
        self.checked = True

    # -- internals ---------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Give waiting prompts (by rank) the free rows of the shortest lanes they fit in, and prefill them."""
        free = [lane.free_rows() for lane in self.lanes]
        taken: list[list[tuple[int, Hashable, list[int]]]] = [[] for _ in self.lanes]
        self.queue.sort()  # nearly sorted already: linear
        waiting = []
        for n, item in enumerate(self.queue):
            if not any(free):
                waiting += self.queue[n:]
                break
            need = len(item[3]) + self.max_new
            i = next((i for i, lane in enumerate(self.lanes) if lane.length >= need and free[i]), None)
            if i is None:
                waiting.append(item)
            else:
                taken[i].append((free[i].pop(0), item[2], item[3]))
        self.queue = waiting
        for lane, jobs in zip(self.lanes, taken, strict=True):
            jobs.sort(key=lambda j: len(j[2]))  # similar lengths share a padded prefill chunk
            while jobs:
                P = len(jobs[-1][2])
                n = max(1, min(len(jobs), PREFILL_TOKENS // P))
                chunk, jobs = jobs[-n:], jobs[:-n]
                for r, key, prompt in chunk:
                    lane.keys[r], lane.reach[r] = key, len(prompt)
                self._prefill(lane, [r for r, _, _ in chunk], [p for _, _, p in chunk])

    def _prefill(self, lane: Lane, rows: list[int], prompts: list[list[int]],
                 record: list[torch.Tensor] | None = None) -> None:
        """Write the prompts' keys into `rows` of `lane` and start their decoding with the first token."""
        dev = self.device
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)  # right-padded: causal attention ignores the pad
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        idx = torch.tensor(rows, device=dev)
        lane.prefill_rows = idx
        try:
            hidden = self.model.get_decoder()(input_ids=ids.to(dev), position_ids=torch.arange(P, device=dev)[None],
                                              past_key_values=lane, use_cache=True).last_hidden_state  # [n, P, H]
        finally:
            lane.prefill_rows = None
        last = hidden[torch.arange(len(prompts), device=dev), lens - 1]  # [n, H]
        logits = self.model.get_output_embeddings()(last)  # [n, V]
        if record is not None:
            record.append(logits)
        first = self.sampler(logits)
        lane.tok[idx] = first[:, None]
        lane.pos[idx] = lens[:, None]
        lane.count[idx] = 1
        lane.out[idx, 0] = first
        lane.done[idx] = torch.isin(first, lane.stops) | (lane.max_new <= 1)

    def _step(self, lane: Lane, record: list[torch.Tensor] | None = None) -> None:
        """One token for each of the first `lane.n` rows; device tensors only, so it can be graph-captured."""
        n = lane.n
        tok, pos, count, done, out = lane.tok[:n], lane.pos[:n], lane.count[:n], lane.done[:n], lane.out[:n]
        mask = lane.slots[:lane.width] <= pos  # [n, width]: what the new token may attend to
        logits = self.model(input_ids=tok, position_ids=pos, attention_mask=mask[:, None, None, :],
                            past_key_values=lane, use_cache=True, logits_to_keep=1).logits[:, -1]  # [n, V]
        if record is not None:
            record.append(logits)
        nxt = self.sampler(logits)
        live = ~done
        col = torch.where(live, count, lane.max_new)  # stopped rows write the scratch column
        out.scatter_(1, col[:, None], nxt[:, None])
        count.add_(live)
        done |= torch.isin(nxt, lane.stops) | (count >= lane.max_new)
        tok.copy_(nxt[:, None])
        pos.add_(live[:, None])

    def _run(self, lanes: list[Lane], steps: int) -> None:
        """`steps` decode steps of each lane, over its rows up to the last busy one (a power of two) and
        attending only as far as they can reach meanwhile (a multiple of an eighth of its length)."""
        for lane in lanes:
            busy = [r for r, k in enumerate(lane.keys) if k is not None]
            lane.n = min(lane.rows, 1 << max(6, busy[-1].bit_length()))
            bucket = max(16, lane.length // 8)
            reach = max(lane.reach[r] for r in busy) + steps
            lane.width = min(lane.length, -(-reach // bucket) * bucket)
            for r in busy:
                lane.reach[r] = min(lane.length, lane.reach[r] + steps)
            step = functools.partial(self._step, lane)
            for _ in range(steps):
                self._graphed(lane, step)()

    def _graphed(self, lane: Lane, step: Any) -> Any:
        """The step replayed as the lane's graph for its current width and rows."""
        return self.step_graphs.get((id(lane), lane.width, lane.n), step)


class StepGraphs:
    """Steps captured once per shape as CUDA graphs and replayed: a step reads and writes device tensors
    at fixed addresses only. A new shape gets two eager warm-up runs on a side stream, then one capture;
    all graphs share one memory pool (they never run at the same time). `enabled` False, or a capture
    that fails (an op that cannot be captured), runs every step eagerly. `generators`: device generators
    the steps draw from, registered with every graph so each replay draws fresh numbers."""

    def __init__(self, device: torch.device, enabled: bool, generators: list[torch.Generator] | None = None
                 ) -> None:
        self.device, self.enabled, self.generators = device, enabled, list(generators or [])
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.warm: dict[Hashable, int] = {}
        self.pool: Any = None
        self.side: torch.cuda.Stream | None = None

    def get(self, shape: Hashable, step: Any) -> Any:
        """What runs `step` for `shape`: the graph's replay, a warm-up run, or `step` itself."""
        if not self.enabled:
            return step
        graph = self.graphs.get(shape)
        if graph is not None:
            return graph.replay
        if self.warm.get(shape, 0) < 2:
            self.warm[shape] = self.warm.get(shape, 0) + 1
            self.side = self.side or torch.cuda.Stream(self.device)
            return lambda: run_on_stream(self.side, step)
        try:
            graph = torch.cuda.CUDAGraph()
            for generator in self.generators:
                graph.register_generator_state(generator)
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                step()
        except RuntimeError as e:  # an op that cannot be captured: run step by step
            warnings.warn(f"CUDA graph capture failed ({str(e)[:160]}); decoding without graphs", stacklevel=2)
            self.enabled = False
            return step
        self.graphs[shape] = graph
        return graph.replay

    def run(self, shape: Hashable, step: Any) -> None:
        self.get(shape, step)()
