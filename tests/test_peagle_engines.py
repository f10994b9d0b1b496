"""vLLM serves eyas' P-EAGLE export (EAGLE-3 + parallel drafting) and counts the acceptance eyas predicts.

Runs in the vLLM venv:
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -m vllm tests/test_peagle_engines.py

The target is a tiny random Llama (no tokenizer: token ids in, token ids out); the draft is a P-EAGLE draft
(two layers, a draft vocabulary of 512 of 2048, so lm_head and d2t are exercised) trained for a few seconds
with eyas' objective on the target's own greedy continuations of the test prompts, so it is accepted often
but not always. Two vLLM starts, one per layout: vLLM's (`LlamaForCausalLMEagle3` + `mask_token_id`, served
with `{"method": "eagle3", "parallel_drafting": true}`) and speculators' (`vllm serve <draft>`). Each output
must be the target's, and the acceptance counters (`vllm:spec_decode_*`) must equal eyas' own chain
speculative decoding of the same draft (eyas.eval.greedy_acceptance), position by position. A wrong mask
token, mask embedding row, mask_hidden, rotary position or d2t shows there.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm")

from _peagle_utils import capture, make_peagle, train_peagle  # noqa: E402
from _vllm_counters import VOCAB, check_counters, confident_llama, prompts_and_continuations, run_vllm  # noqa: E402

from eyas.eval.runner import greedy_acceptance  # noqa: E402
from eyas.export import ServeOptions, export_draft  # noqa: E402
from eyas.model.dflash import choose_mask_token  # noqa: E402

pytestmark = pytest.mark.vllm

K = 3  # proposals per draft forward
MAX_TOKENS = 32
AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target folder, target model, prompts, the target's greedy continuations, trained P-EAGLE draft,
    eyas' predicted counters)."""
    path = tmp_path_factory.mktemp("peagle_engines") / "target"
    target = confident_llama(path)
    prompts, seqs = prompts_and_continuations(target, MAX_TOKENS + K)
    counts = torch.bincount(torch.tensor(sum(seqs, [])), minlength=VOCAB)
    draft = make_peagle(target, AUX, 512, mask_token_id=choose_mask_token(counts, 0), seqs=seqs, layers=2)
    train_peagle(draft, capture(target, seqs, AUX), steps=200, depths=K)
    mine = greedy_acceptance(target, None, draft.eval(), prompts, k=K, max_new_tokens=MAX_TOKENS, ignore_eos=True)
    return path, prompts, seqs, draft, mine


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_vllm_serves_peagle_export_with_the_acceptance_eyas_predicts(tmp_path, setup, layout):
    target_dir, prompts, seqs, draft, mine = setup
    draft_dir = export_draft(draft, tmp_path / layout, layout,
                             ServeOptions(verifier=str(target_dir), dtype="float32", num_speculative_tokens=K))
    if layout == "vllm":
        out, m = run_vllm(prompts, MAX_TOKENS, model=str(target_dir),
                          speculative_config={"method": "eagle3", "parallel_drafting": True, "model": str(draft_dir),
                                              "num_speculative_tokens": K})
    else:  # what `vllm serve <draft>` does: the target from the config, parallel drafting from the model type
        out, m = run_vllm(prompts, MAX_TOKENS, model=str(draft_dir))
    assert out == [s[len(p):len(p) + MAX_TOKENS] for p, s in zip(prompts, seqs, strict=True)]
    # Same draft, same greedy target, one draft forward per step: the counters agree exactly, and every
    # position is accepted sometimes, not always
    check_counters(m, mine)
