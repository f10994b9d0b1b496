"""The DSpark draft (DeepSeek): DFlash's block-parallel backbone, then a Markov head that makes each
proposal depend on the one before it, and a confidence head.

The backbone is DFlash's (eyas.model.dflash: the target's fused aux states as every layer's context, a
block attended without a causal mask inside it), with one difference in what the block's slots mean.
The block is [anchor, MASK x (B-1)] at positions a .. a+B-1 and slot j predicts token a+j+1, so the
anchor's own slot makes the first proposal and one forward proposes B tokens (vLLM's
`sample_from_anchor`; DFlash's slot j predicts token a+j instead). Then, left to right:

    base_j   = lm_head(norm(x_j))                                     [V_d]   the parallel proposal
    markov_j = markov_w1[prev_j]                                      [r]     prev_0 = the anchor, then the
    logits_j = base_j + markov_w2 markov_j                                    proposal before (target ids)
    conf_j   = sigmoid(proj([norm(x_j) ; markov_j]))                          P(proposal j is accepted)

The Markov head is low rank (V x r and r x V_d); only it, the confidence head and the backbone's own
layers train (the embedding and lm_head are the target's, frozen). This is vLLM's `Qwen3DSparkModel`
(qwen3_dspark.py), whose tensor names these modules keep; eyas.export.dspark writes it, the objective is
eyas.train.dspark, the proposer eyas.eval.proposers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from eyas.model.config import DraftConfig
from eyas.model.dflash import DFlashDraft, block_draft_config
from eyas.utils.io import EyasError

ARCHITECTURE = "Qwen3DSparkModel"


class MarkovHead(nn.Module):
    """markov_w1 [V, r] embeds the previous token (a target id); markov_w2 [V_d, r] turns it into a bias."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=True)


class DSparkDraft(DFlashDraft):
    def __init__(self, cfg: DraftConfig) -> None:
        if cfg.markov_rank < 1:
            raise EyasError(f"a dspark draft needs a Markov head: markov_rank {cfg.markov_rank} < 1")
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.draft_vocab_size, cfg.markov_rank)
        self.confidence_head = ConfidenceHead(cfg.hidden_size + cfg.markov_rank)
        self.reset_heads()

    def reset_heads(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.markov_head.markov_w1.weight, std=0.02)
            nn.init.normal_(self.markov_head.markov_w2.weight, std=0.02)
            nn.init.normal_(self.confidence_head.proj.weight, std=0.02)
            nn.init.zeros_(self.confidence_head.proj.bias)

    def markov_embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """[...] previous tokens (target ids) -> [..., r]."""
        return self.markov_head.markov_w1(prev_ids)

    def head_features(self, hidden_out: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """[..., H] slot outputs and [...] previous tokens -> [..., H + r]: what the two heads read.
        `head_weight` is lm_head and markov_w2 side by side, so features @ head_weight.T = base + Markov bias."""
        markov = self.markov_embed(prev_ids).to(hidden_out.dtype)
        return torch.cat([self.norm(hidden_out), markov], dim=-1)

    def head_weight(self) -> torch.Tensor:
        """[V_d, H + r]: lm_head (frozen) beside markov_w2."""
        return torch.cat([self.lm_head.weight, self.markov_head.markov_w2.weight], dim=1)

    def logits_after(self, hidden_out: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """[..., H], [...] -> [..., V_d] draft-vocabulary logits of the proposal after `prev_ids`."""
        features = self.head_features(hidden_out, prev_ids)
        return features @ self.head_weight().to(features.dtype).T

    def confidence_logit(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H + r] `head_features` -> [...] the logit of P(the proposal is accepted)."""
        return self.confidence_head.proj(features.float()).squeeze(-1)


def dspark_config_from_foreign(c: dict[str, Any], where: str, target_config: Any, target: str) -> DraftConfig | None:
    """DraftConfig of vLLM's `Qwen3DSparkModel` config.json (eyas.export.dspark writes it); None for another.
    Refused: `sample_from_anchor` false or missing (the 1+N fill-in block, which this model does not compute;
    vLLM takes a missing one as true, whatever the draft was trained for)."""
    if (c.get("architectures") or []) != [ARCHITECTURE]:
        return None
    if c.get("sample_from_anchor") is not True:
        raise EyasError(f"{where}: a {ARCHITECTURE} config with sample_from_anchor={c.get('sample_from_anchor')!r}: "
                        "eyas' DSpark drafts from the anchor's slot (true); a config without it is served as true "
                        "whatever the draft was trained for. Add \"sample_from_anchor\": true if it was")
    if not c.get("markov_rank"):
        raise EyasError(f"{where}: a {ARCHITECTURE} config without markov_rank: add the Markov head's rank")
    cfg = block_draft_config(c, where, target_config, target, "dspark", ARCHITECTURE)
    return dataclasses.replace(cfg, markov_rank=int(c["markov_rank"]))
