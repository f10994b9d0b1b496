"""Each family's drafting (one proposer a family, declared in eyas.model.family_facts): B rows at once, over a
static draft cache (eyas.model.attention.StaticKVCache), in fixed shapes, greedy or sampled, so a whole round
of the batched decoder (eyas.eval.batch_decode) can be one CUDA graph. The alignment and the pending entries
are eyas.eval.proposer_base's.
"""

from __future__ import annotations

import torch

from eyas.eval.proposer_base import ChainSpec, Method, Pending, Proposal, Proposer, TreeSpec, causal_by_position
from eyas.eval.sampling import Sampling
from eyas.model.attention import StaticKVCache
from eyas.model.dflash import DFlashDraft
from eyas.model.draft import DraftModel
from eyas.model.dspark import DSparkDraft
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.family_facts import family_part


class Eagle3Proposer(Proposer):
    """EAGLE-3: the pending entries in one forward, then K-1 chained steps or an EAGLE-2 tree."""

    draft: Eagle3Draft
    trees = True
    proposals_per_block = None

    def forwards(self, method: Method) -> int:
        return method.k if isinstance(method, ChainSpec) else method.depth

    def _extend(self, cache: StaticKVCache, p: Pending) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending entries into the cache -> the newest one's output [B, 1, H] and logits [B, V_d]."""
        pos, cache.slots = p.positions(cache)
        cache.mask = causal_by_position(cache, pos)
        out = self.draft(p.tokens, self.draft.fuse(p.aux), pos, cache)
        root = out.gather(1, (p.count - 1)[:, None, None].expand(-1, 1, out.shape[-1]))
        return root, self.draft.logits(root)[:, 0].float()

    def chain(self, cache: StaticKVCache, p: Pending, k: int, sampling: Sampling | None = None) -> Proposal:
        """K chained forwards from the newest entry; each step reads the token drafted before it."""
        hidden, logits = self._extend(cache, p)
        tokens, qs = [], []
        for j in range(k):
            t, q = self.pick(logits[:, None], sampling)  # [B, 1]
            tokens.append(t)
            qs.append(q)
            if j < k - 1:
                pos = (p.cached + j)[:, None]
                cache.slots, cache.mask = pos, causal_by_position(cache, pos)
                hidden = self.draft(t, hidden, pos, cache)
                logits = self.draft.logits(hidden)[:, 0].float()
        return torch.cat(tokens, dim=1), None if sampling is None else self.over_target_vocab(torch.cat(qs, dim=1))

    def tree(self, cache: StaticKVCache, p: Pending, spec: TreeSpec
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-2's dynamic tree for every row, the same whether the target samples or not (its nodes are
        point-mass proposals): step d's k frontier entries go to slots L + (d-1)k .. and see the row's prefix
        and their own ancestors. The best `total` nodes by cumulative draft log-prob are kept. Returns target
        ids [B, N], parent index [B, N] in 0..N (0 = the root, node i is index i+1) and depth [B, N]."""
        root, logits = self._extend(cache, p)
        dev, L = root.device, p.cached
        B, H = root.shape[0], root.shape[-1]
        k = min(spec.top_k, logits.shape[-1])
        score, tok = torch.log_softmax(logits, dim=-1).topk(k)  # [B, k]
        pool_score, pool_tok = [score], [tok]
        pool_parent = [torch.full((B, k), -1, device=dev)]
        pool_depth = [torch.ones(B, k, dtype=torch.long, device=dev)]
        frontier_idx = torch.arange(k, device=dev).expand(B, k)
        frontier_score, frontier_tok = score, tok
        hidden = root.expand(B, k, H)
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k)
        ancestors = eye[:, :, :0]
        prefix = (torch.arange(cache.length, device=dev) < L[:, None])[:, None].expand(B, k, cache.length)
        size = k
        for d in range(1, spec.depth):
            ancestors = torch.cat([ancestors, eye], dim=2)  # [B, k, d*k] over the tree entries, this step's last
            tree_slots = L[:, None] + torch.arange(d * k, device=dev)
            cache.slots = tree_slots[:, -k:]
            seen = prefix
            if cache.window:  # from position L - 1 + d, only the last `window` positions of the context
                seen = prefix & (torch.arange(cache.length, device=dev) >= (L + d - cache.window)[:, None])[:, None]
            cache.mask = seen.scatter(2, tree_slots[:, None].expand(B, k, d * k), ancestors)[:, None]
            out = self.draft(self.d2t_ids[frontier_tok], hidden, (L - 1 + d)[:, None].expand(B, k), cache)
            c_score, c_tok = torch.log_softmax(self.draft.logits(out).float(), dim=-1).topk(k, dim=-1)  # [B, k, k]
            c_score = (frontier_score[..., None] + c_score).flatten(1)
            pool_score.append(c_score)
            pool_tok.append(c_tok.flatten(1))
            pool_parent.append(frontier_idx.repeat_interleave(k, dim=1))
            pool_depth.append(torch.full((B, k * k), d + 1, device=dev))
            best = c_score.topk(k).indices  # [B, k] the next frontier
            rows = best // k
            frontier_idx, frontier_score = size + best, c_score.gather(1, best)
            frontier_tok = c_tok.flatten(1).gather(1, best)
            hidden = out.gather(1, rows[..., None].expand(B, k, H))
            ancestors = ancestors.gather(1, rows[..., None].expand(B, k, d * k))
            size += k * k
        scores = torch.cat(pool_score, dim=1)
        n = min(spec.total, scores.shape[1])
        # a child never scores above its parent and comes later in the pool, so a stable sort keeps the
        # selection closed under ancestors; re-sorting by pool index puts parents before children
        chosen = torch.sort(torch.sort(-scores, dim=1, stable=True).indices[:, :n], dim=1).values
        parents = torch.cat(pool_parent, dim=1).gather(1, chosen)
        found = torch.searchsorted(chosen, parents.clamp_min(0).contiguous())
        parent_pos = torch.where(parents < 0, 0, found + 1)
        tokens = self.d2t_ids[torch.cat(pool_tok, dim=1).gather(1, chosen)]
        return tokens, parent_pos, torch.cat(pool_depth, dim=1).gather(1, chosen)


class DFlashProposer(Proposer):
    """DFlash: the draft's cache holds the context only (every layer's keys and values of the target's fused aux
    states, one entry per position in the target's cache). Each round the pending entries join it in the same
    forward as the block [anchor, MASK x K] at rotary positions L .. L+K (L = tokens in the target's cache; the
    anchor is the newest token, not yet in it), which attends to the whole context and to itself, as in
    training (eyas.train.dflash) and in vLLM. Slots 1..K are the K proposals, verified as a chain; the block's
    keys land past the context and are overwritten later."""

    draft: DFlashDraft
    proposals_per_block = -1  # a block of B proposes B - 1 tokens (the anchor's slot proposes none)

    def _write(self, cache: StaticKVCache, tokens: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor) -> None:
        # the context's keys only: a one-slot block rides along, its key parked in the unattended slot
        block = self.draft.block_embeds(self.draft.embed_tokens(tokens[-1:]), 1)
        n = tokens.numel()
        cache.slots = torch.cat([pos, torch.full((1, 1), cache.length - 1, device=pos.device)], dim=1)
        cache.mask = causal_by_position(cache, torch.full((1, 1), n - 1, device=pos.device))
        self.draft(block, torch.full((1, 1), n, device=pos.device), self.draft.context(aux[None]), pos, cache)

    def block_outputs(self, cache: StaticKVCache, p: Pending, size: int) -> torch.Tensor:
        """The pending entries join the context; the block [anchor, MASK x (size-1)] at positions
        L .. L+size-1 attends to the context and the whole block -> its outputs [B, size, H]."""
        draft = self.draft
        ctx_pos, ctx_slots = p.positions(cache)
        block_pos = p.cached[:, None] + torch.arange(size, device=ctx_pos.device)
        cache.slots = torch.cat([ctx_slots, block_pos], dim=1)
        cache.mask = causal_by_position(cache, block_pos[:, -1:])  # the context and the whole block
        block = draft.block_embeds(draft.embed_tokens(p.newest), size)  # [B, size, H]
        return draft(block, block_pos, draft.context(p.aux), ctx_pos, cache)

    def chain(self, cache: StaticKVCache, p: Pending, k: int, sampling: Sampling | None = None) -> Proposal:
        out = self.block_outputs(cache, p, k + 1)
        tokens, q = self.pick(self.draft.logits(out[:, 1:]), sampling)
        return tokens, self.over_target_vocab(q)


class DSparkProposer(DFlashProposer):
    """DSpark: DFlash's block forward with a block of K (the anchor's slot proposes too), then the Markov head
    left to right (eyas.model.dspark): slot j's output, after the Markov bias of the token before it (the
    anchor, then proposal j-1), is proposal j, as vLLM's DSpark speculator with `sample_from_anchor`."""

    draft: DSparkDraft
    proposals_per_block = 0  # every slot proposes, the anchor's too

    def chain(self, cache: StaticKVCache, p: Pending, k: int, sampling: Sampling | None = None) -> Proposal:
        out = self.block_outputs(cache, p, k)  # [B, K, H]: a block of K, K proposals
        prev, tokens, qs = p.newest, [], []
        for j in range(k):
            t, q = self.pick(self.draft.logits_after(out[:, j], prev)[:, None], sampling)  # [B, 1]
            prev = t[:, 0]
            tokens.append(t)
            qs.append(q)
        return torch.cat(tokens, dim=1), None if sampling is None else self.over_target_vocab(torch.cat(qs, dim=1))


class PEagleProposer(Proposer):
    """P-EAGLE: EAGLE-3's draft cache; each round the pending entries (the newest last) join it in the same
    causal forward as K-1 mask slots (the learned mask embedding and fc(mask_hidden)) at positions
    L .. L+K-2. The outputs at the newest entry and at the K-1 slots are the K proposals, verified as a chain:
    vLLM's parallel drafting (eyas.model.peagle)."""

    proposals_per_block = None

    def chain(self, cache: StaticKVCache, p: Pending, k: int, sampling: Sampling | None = None) -> Proposal:
        draft, dtype = self.draft, self.dtype
        B, M = p.tokens.shape
        dev = p.tokens.device
        pend_pos, pend_slots = p.positions(cache)
        mask_pos = p.cached[:, None] + torch.arange(k - 1, device=dev)
        mask_emb, mask_hidden = draft.mask_inputs(k - 1, dtype)
        emb = torch.cat([draft.embed_tokens(p.tokens).to(dtype), mask_emb.expand(B, k - 1, -1)], dim=1)
        hidden = torch.cat([draft.fuse(p.aux).to(dtype), mask_hidden.expand(B, k - 1, -1)], dim=1)
        pos = torch.cat([pend_pos, mask_pos], dim=1)
        cache.slots, cache.mask = torch.cat([pend_slots, mask_pos], dim=1), causal_by_position(cache, pos)
        out = draft(None, hidden, pos, cache, emb)
        take = torch.cat([(p.count - 1)[:, None], M + torch.arange(k - 1, device=dev).expand(B, k - 1)], dim=1)
        out = out.gather(1, take[..., None].expand(B, k, out.shape[-1]))
        tokens, q = self.pick(draft.logits(out), sampling)
        return tokens, self.over_target_vocab(q)


def make_proposer(draft: DraftModel) -> Proposer:
    """The proposer the draft's family declares (eyas.model.family_facts)."""
    return family_part(draft.config.family, "proposer")(draft)
