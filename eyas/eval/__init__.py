"""Speculative decoding evaluation: chain and tree decoding, acceptance metrics, reports and plots.

    from eyas.eval import evaluate_draft, mtbench_set, write_report
    result = evaluate_draft(target, tokenizer, draft, mtbench_set(), chain=[3, 5, 7], tree=["60:7:10"])
    write_report(result, "eval/")
"""

from eyas.eval.batch_decode import BatchDecoder
from eyas.eval.metrics import BASELINE, Generation, MethodStats
from eyas.eval.prompts import PromptItem, PromptSet, humaneval_set, load_prompt_sets, mtbench_set
from eyas.eval.proposer_base import ChainSpec, TreeSpec
from eyas.eval.report import load_report, write_report
from eyas.eval.runner import EvalResult, evaluate_draft, greedy_acceptance
from eyas.eval.target import HFTarget

__all__ = [
    "BASELINE", "BatchDecoder", "ChainSpec", "EvalResult", "Generation", "HFTarget", "MethodStats", "PromptItem",
    "PromptSet", "TreeSpec", "evaluate_draft", "greedy_acceptance", "humaneval_set", "load_prompt_sets",
    "load_report", "mtbench_set", "write_report",
]
