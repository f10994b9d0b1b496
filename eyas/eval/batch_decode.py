"""Speculative decoding (or the target alone) of many prompts at once, greedy or sampled, over static KV caches,
each round one CUDA graph: eyas' one decoder, for every family and every target eval takes.

The target's cache is the regeneration decoder's `Lane` (eyas.generate.graph_decode: one preallocated KV
cache of `rows` sequences, written through transformers' cache contract, attended with its grouped
attention, checked against a plain forward by `check_model`); the draft's is a StaticKVCache. One round
of every row (the family's drafting, eyas.eval.proposers; the target's verify forward over a chain of
K+1 tokens or an EAGLE-2 tree with its mask; greedy acceptance, or lossless rejection sampling per row
(eyas.eval.sampling) with the decoder's device generator; moving a tree's accepted path into place;
the output, stop test and counters) reads and writes device tensors only, so it is captured once per
attended width and replayed (`StepGraphs`); on a CPU it runs as it is. Each row accepts its own number
of tokens; the host looks every `rounds_per_poll` rounds, hands the finished rows their next prompt
(prefilled eagerly) and keeps the rest going. An MLA target caches a latent in place of keys and values:
the Lane takes whatever shapes the layers write.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from eyas.eval.metrics import Generation
from eyas.eval.proposer_base import ChainSpec, Method, Pending, Proposer
from eyas.eval.sampling import Sampling, accept_chain, accept_tree
from eyas.eval.target import HFTarget
from eyas.generate.graph_decode import Lane, StepGraphs, attention_of
from eyas.model.attention import StaticKVCache


class BatchDecoder:
    """`rows` prompts decoded together with `method` (None: the target alone); `run(prompts)` -> Generations
    (their `seconds` are left 0: a batch is timed as a whole). `length`: cache slots per row, at least the
    longest prompt + max_new_tokens + `margin(method)`. temperature 0 is greedy; above it every token follows
    the target's own sampling distribution (temperature, top_p), drawn from one device generator (`seed`)."""

    def __init__(self, target: HFTarget, proposer: Proposer | None, method: Method | None, rows: int,
                 length: int, max_new_tokens: int, stop_ids: Sequence[int], graphs: bool | None = None,
                 rounds_per_poll: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> None:
        if method is not None and proposer is not None:
            proposer.check(method)
        self.target, self.proposer, self.method = target, proposer, method
        self.sampling = (Sampling(temperature, top_p, torch.Generator(device=target.device).manual_seed(seed))
                         if temperature > 0 else None)
        self.model, dev = target.model, target.device
        self.rows, self.length, self.max_new = rows, length, max_new_tokens
        cuda = dev.type == "cuda"
        self.graphs = StepGraphs(dev, cuda if graphs is None else graphs,
                                 [self.sampling.generator] if self.sampling else [])
        if rounds_per_poll is None:
            rounds_per_poll = (4 if method is None else 2) if self.graphs.enabled else 1
        self.rounds_per_poll = rounds_per_poll
        self.stops = torch.tensor(sorted(stop_ids) or [-1], dtype=torch.long, device=dev)
        M = 1 if method is None else method.max_accept + 1  # pending entries: the accepted tokens + the next
        self.lane = Lane(len(target.layers), rows, length, 1, self.stops, 0)
        self.dcache = StaticKVCache(rows, length, proposer.window) if proposer is not None else None
        k_h = len(target.aux_layer_ids) * target.hidden_size
        self.pending = Pending(torch.zeros(rows, M, dtype=torch.long, device=dev),
                               torch.zeros(rows, M, k_h, dtype=target.dtype, device=dev),
                               torch.ones(rows, dtype=torch.long, device=dev),
                               torch.ones(rows, dtype=torch.long, device=dev))
        self.count = torch.zeros(rows, dtype=torch.long, device=dev)
        self.done = torch.ones(rows, dtype=torch.bool, device=dev)
        self.out = torch.zeros(rows, max_new_tokens + M, dtype=torch.long, device=dev)  # last column: scratch
        self.rounds = torch.zeros(rows, dtype=torch.long, device=dev)
        self.accepted = torch.zeros(rows, max_new_tokens + 2, dtype=torch.long, device=dev)  # last column: scratch
        self.keys: list[Hashable | None] = [None] * rows
        self.reach = [0] * rows  # host: the most tokens a row's target cache can hold by now
        self.bucket = max(16, -(-length // 8))

    @staticmethod
    def margin(method: Method | None) -> int:
        """Cache slots a row needs past its answer: the speculation verified or drafted in one round."""
        if method is None:
            return 2
        if isinstance(method, ChainSpec):
            return 2 * method.k + 4
        return max(method.total + 1, method.top_k * method.depth) + method.depth + 4

    @property
    def spec_tokens(self) -> int:
        m = self.method
        return 1 if m is None else m.k + 1 if isinstance(m, ChainSpec) else m.total + 1

    # -- public ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self) -> None:
        """Capture every width's round while all rows are idle, so nothing is captured while timed."""
        if not self.graphs.enabled:
            return
        self.target.capture = self.proposer is not None
        try:
            with attention_of(self.model):
                for width in range(self.bucket, self.length + self.bucket, self.bucket):
                    self.lane.width = min(width, self.length)
                    for _ in range(3):
                        self.graphs.run(self.lane.width, self._round)
        finally:
            self.target.capture = True
        torch.cuda.synchronize(self.target.device)

    @torch.inference_mode()
    def run(self, prompts: Sequence[list[int]], seed: int | None = None) -> list[Generation]:
        """Decode every prompt (token ids); the results come back in the order given. `seed` (sampling):
        reseed the decoder's generator first."""
        if seed is not None and self.sampling is not None:
            self.sampling.generator.manual_seed(seed)
        queue = list(enumerate(prompts))[::-1]
        results: list[Generation | None] = [None] * len(prompts)
        self.target.capture = self.proposer is not None
        try:
            with attention_of(self.model):
                while queue or any(k is not None for k in self.keys):
                    for r in range(self.rows):
                        if self.keys[r] is None and queue:
                            key, prompt = queue.pop()
                            self._admit(r, key, prompt)
                    self._advance()
                    self._collect(results)
        finally:
            self.target.capture = True
        return results  # type: ignore[return-value]

    # -- internals ---------------------------------------------------------------------------------

    def _admit(self, r: int, key: Hashable, prompt: list[int]) -> None:
        """Prefill `prompt` into row r and set the row's state to decode from its first token."""
        dev, P = self.target.device, len(prompt)
        ids = torch.tensor([prompt], device=dev)
        self.lane.prefill_rows = torch.tensor([r], device=dev)
        try:
            hidden = self.model.get_decoder()(input_ids=ids, position_ids=torch.arange(P, device=dev)[None],
                                              past_key_values=self.lane, use_cache=True).last_hidden_state
        finally:
            self.lane.prefill_rows = None
        logits = self.model.get_output_embeddings()(hidden[:, -1])  # [1, V]
        first = logits.argmax(-1) if self.sampling is None else self.sampling.draw(self.sampling.probs(logits))
        p = self.pending
        p.cached[r], p.count[r], p.tokens[r, 0] = P, 1, first[0]
        if self.proposer is not None:
            aux = torch.cat([self.target._captured[i][0] for i in self.target.aux_layer_ids], dim=-1)  # [P, k*H]
            self.target._captured.clear()
            p.aux[r, 0] = aux[-1]
            self.proposer.prefill(self.dcache, r, ids[0, 1:], aux[:-1])
        self.count[r], self.out[r, 0], self.rounds[r] = 1, first[0], 0
        self.done[r] = torch.isin(first, self.stops)[0] | (self.max_new <= 1)
        self.keys[r], self.reach[r] = key, P

    def _advance(self) -> None:
        """`rounds_per_poll` rounds of every row, attending as far as the busy rows can reach meanwhile."""
        busy = [r for r, k in enumerate(self.keys) if k is not None]
        steps = self.rounds_per_poll
        grow = 1 if self.method is None else self.method.max_accept + 1
        reach = max(self.reach[r] for r in busy) + grow * (steps - 1) + self.spec_tokens
        self.lane.width = min(self.length, -(-reach // self.bucket) * self.bucket)
        for _ in range(steps):
            self.graphs.run(self.lane.width, self._round)

    def _collect(self, results: list[Generation | None]) -> None:
        """Read which rows finished (one host sync) and turn them into Generations."""
        done, count, cached, rounds = torch.stack([self.done.long(), self.count, self.pending.cached,
                                                   self.rounds]).tolist()
        forwards = 0 if self.proposer is None else self.proposer.forwards(self.method)
        for r, key in enumerate(self.keys):
            if key is None:
                continue
            self.reach[r] = cached[r]
            if done[r]:
                n = min(count[r], self.max_new)
                tokens, acc = self.out[r, :n].tolist(), self.accepted[r, :rounds[r]].tolist()
                results[key] = Generation(tokens, 0.0, 1 + rounds[r], forwards * rounds[r],
                                          acc if self.method is not None else [])
                self.keys[r] = None

    def _round(self) -> None:
        """One round of every row; device tensors only (captured as a CUDA graph)."""
        p, lane, m, sampling = self.pending, self.lane, self.method, self.sampling
        dev, L = self.target.device, p.cached
        q = parents = depth = ancestors = None
        if m is None:
            ids = p.newest[:, None]
        elif isinstance(m, ChainSpec):
            drafts, q = self.proposer.chain(self.dcache, p, m.k, sampling)
            ids = torch.cat([p.newest[:, None], drafts], dim=1)
        else:
            tokens, parents, depth = self.proposer.tree(self.dcache, p, m)
            ids = torch.cat([p.newest[:, None], tokens], dim=1)
        T = ids.shape[1]
        lane.write = L[:, None] + torch.arange(T, device=dev)
        if m is None or isinstance(m, ChainSpec):
            positions = lane.write
            mask = torch.arange(lane.width, device=dev) <= positions[..., None]  # [B, T, width]
        else:
            positions = L[:, None] + torch.cat([torch.zeros_like(depth[:, :1]), depth], dim=1)
            ancestors = _tree_ancestors(parents, m.depth)
            prefix = (torch.arange(lane.width, device=dev) < L[:, None])[:, None].expand(-1, T, -1)
            columns = lane.write.clamp(max=lane.width - 1)  # finished rows may lie past the width: never read
            mask = prefix.scatter(2, columns[:, None].expand(-1, T, -1), ancestors)
        try:
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask[:, None],
                             past_key_values=lane, use_cache=True, **({"logits_to_keep": 1} if m is None else {}))
        finally:
            lane.write = None
        if sampling is None:
            acc, path, new = self._accept_greedy(ids, out.logits.argmax(-1), parents, depth, ancestors)
        else:
            acc, path, new = self._accept_sampled(ids, sampling.probs(out.logits), q, parents)
        if m is not None and not isinstance(m, ChainSpec):
            self._keep_path(L, path[:, 1:])
        self._commit(new, acc, path)

    def _accept_greedy(self, ids: torch.Tensor, best: torch.Tensor, parents: torch.Tensor | None,
                       depth: torch.Tensor | None, ancestors: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accept what the target's argmax agrees with -> counts [B], verify indices [B, M] of the root and the
        accepted nodes, and the new tokens [B, M] (the accepted ones, then the target's next)."""
        m = self.method
        if m is None:
            acc, path = torch.zeros_like(ids[:, 0]), torch.zeros_like(ids)
        elif isinstance(m, ChainSpec):
            acc = (ids[:, 1:] == best[:, :-1]).cumprod(1).sum(1)
            path = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        else:
            acc, path = _walk_tree(ids, parents, depth, best, ancestors, m.depth)
        return acc, path, best.gather(1, path)

    def _accept_sampled(self, ids: torch.Tensor, probs: torch.Tensor, q: torch.Tensor | None,
                        parents: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rejection sampling per row (eyas.eval.sampling); returns what `_accept_greedy` does."""
        m, gen = self.method, self.sampling.generator
        if m is None:
            nxt = self.sampling.draw(probs[:, -1])
            return torch.zeros_like(nxt), torch.zeros_like(ids), nxt[:, None]
        if isinstance(m, ChainSpec):
            acc, nxt = accept_chain(ids[:, 1:], q, probs, gen)
            path = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        else:
            acc, path, nxt = accept_tree(ids, parents, probs, m.depth, gen)
        new = torch.cat([ids.gather(1, path[:, 1:]), torch.zeros_like(nxt[:, None])], dim=1)
        return acc, path, new.scatter(1, acc[:, None], nxt[:, None])

    def _commit(self, new: torch.Tensor, acc: torch.Tensor, path: torch.Tensor) -> None:
        """new [B, M]: the accepted tokens then the target's next (acc + 1 of them valid), path [B, M] their
        verify indices. Live rows append them (up to a stop token), count, and carry them to the next round."""
        p, live = self.pending, ~self.done
        j = torch.arange(new.shape[1], device=new.device)
        valid = j <= acc[:, None]
        is_stop = torch.isin(new, self.stops) & valid
        stopped = is_stop.any(1)
        take = torch.where(stopped, is_stop.int().argmax(1) + 1, acc + 1)
        cols = torch.where(live[:, None], self.count[:, None] + j, self.out.shape[1] - 1)
        self.out.scatter_(1, cols, new)
        at = torch.where(live, self.rounds, self.accepted.shape[1] - 1)[:, None]
        self.accepted.scatter_(1, at, acc[:, None])
        self.rounds.add_(live)
        self.count.add_(torch.where(live, take, 0))
        self.done |= live & (stopped | (self.count >= self.max_new))
        p.cached.add_(torch.where(live, acc + 1, 0))
        p.count.copy_(torch.where(live, acc + 1, p.count))
        p.tokens.copy_(torch.where(live[:, None], new, p.tokens))
        if self.proposer is not None:
            aux = torch.cat([self.target._captured[i] for i in self.target.aux_layer_ids], dim=-1)  # [B, T, k*H]
            self.target._captured.clear()
            aux = aux.gather(1, path[..., None].expand(-1, -1, aux.shape[-1]))
            p.aux.copy_(torch.where(live[:, None, None], aux, p.aux))

    def _keep_path(self, L: torch.Tensor, path: torch.Tensor) -> None:
        """Move each row's accepted tree nodes (verify indices path [B, D], in depth order) to the slots
        right after the root, in every layer of the target's cache; what lies past them is overwritten later."""
        src = L[:, None] + path
        dst = L[:, None] + 1 + torch.arange(path.shape[1], device=path.device)
        for t in [*self.lane.k, *self.lane.v]:
            if t is not None:
                shape = (-1, t.shape[1], -1, t.shape[3])
                t.scatter_(2, dst[:, None, :, None].expand(shape), t.gather(2, src[:, None, :, None].expand(shape)))


def _tree_ancestors(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """parents [B, N] (0 = the root) -> [B, N+1, N+1] bool: node i's ancestors and itself, the root first."""
    B, N = parents.shape
    parent_all = torch.cat([torch.zeros_like(parents[:, :1]), parents], dim=1)
    eye = torch.eye(N + 1, dtype=torch.bool, device=parents.device).expand(B, -1, -1)
    ancestors = eye
    for _ in range(depth):  # row i |= row parent(i): after d rounds, paths of length d are complete
        ancestors = eye | ancestors.gather(1, parent_all[..., None].expand(-1, -1, N + 1))
    return ancestors


def _walk_tree(ids: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, best: torch.Tensor,
               ancestors: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance over a tree, on the device: a node is accepted when it and all its ancestors are
    the target's argmax at their parents. Siblings are distinct tokens, so the accepted nodes form one
    path; its deepest node ends it. Returns accepted counts [B] and the path [B, depth+1] (root first;
    entries past the accepted count are the root)."""
    B, N1 = ids.shape
    ok = torch.cat([torch.ones_like(ids[:, :1], dtype=torch.bool), ids[:, 1:] == best.gather(1, parents)], dim=1)
    accepted = ~(ancestors & ~ok[:, None, :]).any(-1)  # [B, N+1]
    depth_all = torch.cat([torch.zeros_like(depth[:, :1]), depth], dim=1)
    deepest = torch.where(accepted, depth_all, -1).argmax(1)  # [B]
    acc = depth_all.gather(1, deepest[:, None])[:, 0]
    on_path = ancestors.gather(1, deepest[:, None, None].expand(-1, 1, N1))[:, 0]  # [B, N+1]
    path = torch.zeros(B, max_depth + 2, dtype=torch.long, device=ids.device)  # last column: scratch
    path.scatter_(1, torch.where(on_path, depth_all, max_depth + 1), torch.arange(N1, device=ids.device).expand(B, -1))
    return acc, path[:, :max_depth + 1]
