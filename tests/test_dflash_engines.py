"""vLLM serves eyas' DFlash export (`method: dflash`) and counts the acceptance eyas predicts.

Runs in the vLLM venv:
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -m vllm tests/test_dflash_engines.py

The target is a tiny random Llama (no tokenizer: token ids in, token ids out); the draft is a DFlash
draft (blocks of 4, a draft vocabulary of 512 of 2048, so lm_head and d2t are exercised) trained for
a few seconds with eyas' objective on the target's own greedy continuations of the test prompts, so
it is accepted often but not always. One vLLM start: its output must be the target's, and its acceptance counters
(`vllm:spec_decode_*`) must equal eyas' own chain speculative decoding of the same draft
(eyas.eval.greedy_acceptance), slot by slot. A wrong layer-id convention, mask token, rotary
position, context window or d2t shows there.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm")

from _dflash_utils import capture, make_dflash, train_dflash  # noqa: E402
from _vllm_counters import VOCAB, check_counters, confident_llama, prompts_and_continuations, run_vllm  # noqa: E402

from eyas.eval.runner import greedy_acceptance  # noqa: E402
from eyas.export import ServeOptions, export_draft  # noqa: E402
from eyas.model.dflash import choose_mask_token  # noqa: E402

pytestmark = pytest.mark.vllm

K = 3  # proposals per block (block size 4)
MAX_TOKENS = 32
AUX = [1, 2, 3]  # DFlash target_layer_ids 0, 1, 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target folder, target model, prompts, the target's greedy continuations, trained DFlash draft)."""
    path = tmp_path_factory.mktemp("dflash_engines") / "target"
    target = confident_llama(path)
    prompts, seqs = prompts_and_continuations(target, MAX_TOKENS + K)
    counts = torch.bincount(torch.tensor(sum(seqs, [])), minlength=VOCAB)
    draft = make_dflash(target, AUX, 512, block_size=K + 1, mask_token_id=choose_mask_token(counts, 0), seqs=seqs)
    train_dflash(draft, capture(target, seqs, AUX), steps=200, anchors=24)
    return path, target, prompts, seqs, draft


def test_vllm_serves_dflash_export_with_the_acceptance_eyas_predicts(tmp_path, setup):
    target_dir, target, prompts, seqs, draft = setup
    draft_dir = export_draft(draft, tmp_path / "vllm", "vllm", ServeOptions(verifier=str(target_dir), dtype="float32"))
    out, m = run_vllm(prompts, MAX_TOKENS, model=str(target_dir),
                      speculative_config={"method": "dflash", "model": str(draft_dir), "num_speculative_tokens": K})
    assert out == [s[len(p):len(p) + MAX_TOKENS] for p, s in zip(prompts, seqs, strict=True)]

    mine = greedy_acceptance(target, None, draft.eval(), prompts, k=K, max_new_tokens=MAX_TOKENS, ignore_eos=True)
    # Same draft, same greedy target, one draft forward per step: the counters agree exactly (measured:
    # 54 steps, [42, 17, 17] accepted per slot in both, tau 2.41), every slot accepted sometimes, not always
    check_counters(m, mine)
