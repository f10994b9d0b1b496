"""Speculative decoding with a draft: chains and (EAGLE-3) EAGLE-2 dynamic trees, greedy or sampled.

Both models keep KV caches; nothing of the prefix is recomputed. One round:

    draft:  append the pending entries (accepted tokens + the target's aux states at them), then
            propose K tokens (chain) or a tree of `total` tokens (top-k expansion, `depth` steps)
    target: verify everything in ONE forward (a 4-D tree mask for trees), capturing aux states
    accept: greedy matching or lossless rejection sampling (eyas.eval.sampling)
    caches: the target keeps the prefix + the accepted path; the draft drops its speculative entries

Alignment (the same as EAGLE-3 training and vLLM): draft entry t holds the embedding of token
t+1 and the target's hidden state at t, at rotary position t, and predicts token t+2. With L
tokens in the target's cache, the draft's j-th speculative token is processed at position L-1+j.
The draft side is the proposer the draft's family declares (`make_proposer`): Eagle3Proposer here, the
others in their own modules (DFlash's eyas.eval.block_proposer, P-EAGLE's eyas.eval.parallel_proposer:
one forward per round, chains only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eyas.eval.proposer_base import ChainSpec, DraftProposer, Method, TreeSpec
from eyas.eval.sampling import (
    sample,
    target_probs,
    verify_chain_greedy,
    verify_chain_sampling,
    walk_tree_greedy,
    walk_tree_sampling,
)
from eyas.eval.target import HFTarget, cache_crop, cache_keep
from eyas.model.attention import KVCache
from eyas.model.draft import DraftModel
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.family_facts import family_part


@dataclass
class Generation:
    """One generated answer and how it was produced."""

    tokens: list[int]
    seconds: float
    target_forwards: int  # including the prefill
    draft_forwards: int = 0
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per verify step (bonus excluded)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _finish(out: list[int], new: list[int], stop_ids: set[int], max_new_tokens: int) -> bool:
    """Append `new` to `out` up to the first stop token or the length limit; True when done."""
    for t in new:
        out.append(t)
        if t in stop_ids or len(out) >= max_new_tokens:
            return True
    return False


@torch.inference_mode()
def target_generate(target: HFTarget, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0, stop_ids: set[int] | frozenset = frozenset(),
                    generator: torch.Generator | None = None) -> Generation:
    """The target alone, KV-cached, one token per forward: the reference output and the speed baseline."""
    dev = target.device
    target.capture = False
    try:
        _sync(dev)
        t0 = time.perf_counter()
        cache = target.new_cache()
        ids = torch.tensor([prompt_ids], device=dev)
        pos = torch.arange(len(prompt_ids), device=dev)[None]
        out: list[int] = []
        forwards = 0
        while True:
            logits, _ = target.forward(ids, pos, cache, last_logits_only=True)
            forwards += 1
            nxt = logits[-1].argmax() if temperature <= 0 else sample(target_probs(logits[-1], temperature, top_p),
                                                                      generator)
            token = int(nxt)
            if _finish(out, [token], stop_ids, max_new_tokens):
                break
            ids = nxt.view(1, 1)
            pos = pos[:, -1:] + 1
        _sync(dev)
        return Generation(out, time.perf_counter() - t0, forwards)
    finally:
        target.capture = True


class Eagle3Proposer(DraftProposer):
    """EAGLE-3's drafting: the pending entries extend the draft's KV cache (one forward), then K-1
    chained forwards (chain) or an EAGLE-2 dynamic tree of `depth - 1` more. A proposer is what
    SpeculativeDecoder asks for drafts (eyas.eval.block_proposer holds DFlash's)."""

    draft: Eagle3Draft

    def check(self, method: Method) -> None:
        """Every chain and tree is an EAGLE-3 draft's to propose."""

    def forwards(self, method: Method) -> int:
        """Draft forwards per verify step."""
        return method.k if isinstance(method, ChainSpec) else method.depth

    def chain(self, cache: KVCache, pending_tokens: torch.Tensor, pending_aux: torch.Tensor, k: int,
              temperature: float, top_p: float, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Take in the pending entries (tokens [m], the newest last; the target's aux states at the
        positions before them [m, k*H]) and propose K tokens: target ids [K] and (sampling) q [K, V]."""
        root, root_logits = self._extend(cache, pending_tokens, pending_aux)
        return self._draft_chain(cache, root, root_logits, k, temperature, top_p, generator)

    def tree(self, cache: KVCache, pending_tokens: torch.Tensor, pending_aux: torch.Tensor, spec: TreeSpec
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Take in the pending entries and draft an EAGLE-2 tree (see `_draft_tree`)."""
        root, root_logits = self._extend(cache, pending_tokens, pending_aux)
        return self._draft_tree(cache, root, root_logits, spec)

    def _draft_step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [1, T] (target ids), hidden [1, T, H], positions [1, T] -> (out [1, T, H], logits [T, V_d])."""
        out = self.draft(tokens, hidden, positions, cache)
        return out, self.draft.logits(out)[0].float()

    def _extend(self, cache: KVCache, tokens: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append pending entries (tokens [m], target aux [m, k*H]); return the last one's output and logits."""
        start = cache.length
        positions = torch.arange(start, start + tokens.numel(), device=self.device)[None]
        hidden = self.draft.fuse(aux[None].to(self.dtype))
        cache.mask = None
        out, logits = self._draft_step(tokens[None], hidden, positions, cache)
        return out[:, -1:], logits[-1]

    def _draft_chain(self, cache: KVCache, root: torch.Tensor, logits: torch.Tensor, k: int, temperature: float,
                     top_p: float, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K tokens from the root; returns target ids [K] and (sampling) the draft's q [K, V] over target ids."""
        L = cache.length  # == tokens in the target cache
        tokens, qs = [], []
        hidden = root
        for j in range(k):
            if temperature <= 0:
                d = logits.argmax()
            else:
                q = target_probs(logits, temperature, top_p)
                d = sample(q, generator)
                qs.append(q)
            t = self.d2t_ids[d]
            tokens.append(t)
            if j < k - 1:
                hidden, step_logits = self._draft_step(t.view(1, 1), hidden,
                                                       torch.full((1, 1), L + j, device=self.device), cache)
                logits = step_logits[0]
        cache.crop(L)
        draft_tokens = torch.stack(tokens)
        if temperature <= 0:
            return draft_tokens, None
        return draft_tokens, self._over_target_vocab(torch.stack(qs))

    def _draft_tree(self, cache: KVCache, root: torch.Tensor, logits: torch.Tensor,
                    spec: TreeSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-2 dynamic tree. Returns, for the N selected nodes in creation order: target token ids [N],
        parent index [N] in 0..N (0 = the root, node i is index i+1), depth [N] (1..depth) and the
        cumulative draft log-prob [N] they were selected by."""
        dev, k, L = self.device, spec.top_k, cache.length
        k = min(k, logits.shape[-1])
        logp = torch.log_softmax(logits, dim=-1)
        score, tok = logp.topk(k)  # [k]
        pool_score, pool_tok = [score], [tok]
        pool_parent = [torch.full((k,), -1, device=dev)]
        pool_depth = [torch.ones(k, dtype=torch.long, device=dev)]
        frontier_idx = torch.arange(k, device=dev)  # pool index of each frontier node
        frontier_score, frontier_tok = score, tok
        hidden = root.expand(1, k, root.shape[-1])
        ancestors = torch.zeros(k, 0, dtype=torch.bool, device=dev)  # over the tree entries already cached
        eye = torch.eye(k, dtype=torch.bool, device=dev)
        size = k
        for d in range(1, spec.depth):
            context = torch.ones(k, L, dtype=torch.bool, device=dev)
            if cache.window:  # a sliding-window draft: from position L - 1 + d, only the last `window` positions
                context[:, : max(0, L + d - cache.window)] = False
            cache.mask = torch.cat([context, ancestors, eye], dim=1)[None, None]
            positions = torch.full((1, k), L - 1 + d, device=dev)
            out, step_logits = self._draft_step(self.d2t_ids[frontier_tok][None], hidden, positions, cache)
            c_score, c_tok = torch.log_softmax(step_logits, dim=-1).topk(k, dim=-1)  # [k, k]
            c_score = frontier_score[:, None] + c_score
            pool_score.append(c_score.flatten())
            pool_tok.append(c_tok.flatten())
            pool_parent.append(frontier_idx.repeat_interleave(k))
            pool_depth.append(torch.full((k * k,), d + 1, device=dev))
            best = c_score.flatten().topk(k).indices  # the next frontier
            rows = best // k
            frontier_idx, frontier_score, frontier_tok = size + best, c_score.flatten()[best], c_tok.flatten()[best]
            hidden = out[:, rows]
            ancestors = torch.cat([ancestors, eye], dim=1)[rows]
            size += k * k
        cache.mask = None
        cache.crop(L)
        scores = torch.cat(pool_score)
        n = min(spec.total, scores.numel())
        # a child never scores above its parent and comes later in the pool, so a stable sort keeps the
        # selection closed under ancestors; re-sorting by pool index puts parents before children
        chosen = torch.sort(torch.sort(-scores, stable=True).indices[:n]).values
        parents = torch.cat(pool_parent)[chosen]
        parent_pos = torch.where(parents < 0, 0, torch.searchsorted(chosen, parents.clamp_min(0)) + 1)
        return self.d2t_ids[torch.cat(pool_tok)[chosen]], parent_pos, torch.cat(pool_depth)[chosen], scores[chosen]



def make_proposer(draft: DraftModel, device: torch.device, vocab: int) -> DraftProposer:
    """The proposer the draft's family declares (eyas.model.family_facts)."""
    return family_part(draft.config.family, "proposer")(draft, device, vocab)


class SpeculativeDecoder:
    """Target + draft (any family, through its proposer), batch 1. `generate(prompt, method, ...)` -> Generation."""

    def __init__(self, target: HFTarget, draft: DraftModel, stop_ids: set[int] | frozenset = frozenset()) -> None:
        if list(draft.config.aux_layer_ids) != target.aux_layer_ids:
            raise ValueError("the target must capture the draft's aux layer ids")
        self.target, self.draft = target, draft.eval()
        self.stop_ids = set(stop_ids)
        self.device = target.device
        self.proposer = make_proposer(self.draft, target.device, target.vocab_size)
        self.draft_dtype = self.proposer.dtype

    def verify_tree(self, cache, tree_ids: torch.Tensor, parent_all: torch.Tensor, depth: torch.Tensor,
                    max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over a whole tree. tree_ids [N+1] (root first), parent_all [N+1] (root's = 0),
        depth [N] of the non-root nodes -> logits [N+1, V], aux [N+1, k*H]. Each node sees the cached
        prefix and its own ancestors, at rotary position prefix + its depth."""
        dev, L = self.device, cache.get_seq_length()
        eye = torch.eye(tree_ids.numel(), dtype=torch.bool, device=dev)
        ancestors = eye
        for _ in range(max_depth):  # row i |= row parent(i): after d rounds, paths of length d are complete
            ancestors = eye | ancestors[parent_all]
        positions = L + torch.cat([torch.zeros(1, dtype=torch.long, device=dev), depth])
        return self.target.forward(tree_ids[None], positions[None], cache,
                                   attention_mask=self.target.tree_mask(L, ancestors))

    # -- one generation --------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], method: Method, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, generator: torch.Generator | None = None) -> Generation:
        dev, target = self.device, self.target
        greedy = temperature <= 0
        _sync(dev)
        t0 = time.perf_counter()
        cache, dcache = target.new_cache(), self.proposer.new_cache()
        n = len(prompt_ids)
        ids = torch.tensor(prompt_ids, device=dev)
        logits, aux = target.forward(ids[None], torch.arange(n, device=dev)[None], cache, last_logits_only=True)
        first = logits[-1].argmax() if greedy else sample(target_probs(logits[-1], temperature, top_p), generator)
        gen = Generation([], 0.0, target_forwards=1)
        done = _finish(gen.tokens, [int(first)], self.stop_ids, max_new_tokens)
        pending_tokens = torch.cat([ids[1:], first.view(1)])  # entry t: token t+1 with the target's state at t
        pending_aux = aux
        last = first.view(1)  # the newest token: sampled, not yet in the target's cache
        while not done:
            L = cache.get_seq_length()
            gen.draft_forwards += self.proposer.forwards(method)
            if isinstance(method, ChainSpec):
                drafts, q = self.proposer.chain(dcache, pending_tokens, pending_aux, method.k, temperature, top_p,
                                                generator)
                K = drafts.numel()
                verify_ids = torch.cat([last, drafts])
                logits, aux = target.forward(verify_ids[None], torch.arange(L, L + K + 1, device=dev)[None], cache)
                if greedy:
                    both = torch.cat([drafts, logits.argmax(-1)]).tolist()
                    accepted, nxt = verify_chain_greedy(both[:K], both[K:])
                    new_host = both[:accepted]
                else:
                    accepted, nxt = verify_chain_sampling(drafts, q, target_probs(logits, temperature, top_p),
                                                          generator)
                    new_host = drafts[:accepted].tolist()
                cache_crop(cache, L + accepted + 1)
                path = torch.arange(1, accepted + 1, device=dev)
                new_tokens = drafts[:accepted]
            else:
                tokens, parents, depth, _ = self.proposer.tree(dcache, pending_tokens, pending_aux, method)
                tree_ids = torch.cat([last, tokens])  # [N+1], the root first
                parent_all = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), parents])
                logits, aux = self.verify_tree(cache, tree_ids, parent_all, depth, method.depth)
                if greedy:
                    host = torch.stack([parent_all, tree_ids, logits.argmax(-1)]).tolist()
                    path_l, nxt = walk_tree_greedy(host[0], host[1], host[2])
                else:
                    host = torch.stack([parent_all, tree_ids]).tolist()
                    path_l, nxt = walk_tree_sampling(host[0], host[1], target_probs(logits, temperature, top_p),
                                                     generator)
                accepted = len(path_l)
                new_host = [host[1][i] for i in path_l]
                path = torch.tensor(path_l, dtype=torch.long, device=dev)
                cache_keep(cache, L + 1, L + path)  # the prefix, the root, the accepted path
                new_tokens = tree_ids[path]
            gen.target_forwards += 1
            gen.accepted.append(accepted)
            last = torch.tensor([nxt], device=dev)
            pending_tokens = torch.cat([new_tokens, last])
            pending_aux = aux[torch.cat([torch.zeros(1, dtype=torch.long, device=dev), path])]
            done = _finish(gen.tokens, new_host + [nxt], self.stop_ids, max_new_tokens)
        _sync(dev)
        gen.seconds = time.perf_counter() - t0
        return gen
