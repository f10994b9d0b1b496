"""The checkpoint layouts an EAGLE-3 draft is written and read in: the facts writers and readers share.

Every engine reads the same tensors, under different names and with different config conventions.
The differences that silently cost acceptance, and how each layout spells them:

| | eyas / vLLM | speculators | SGLang / SpecForge | EAGLE (yuhuili) |
| --- | --- | --- | --- | --- |
| decoder layer names | `layers.0.*` | `layers.0.*` | `midlayer.*` | `midlayer.*` |
| aux layer ids | `eagle_aux_hidden_state_layer_ids` = k | same, top level | `eagle_config`: k - 1 | [2, N//2, N-3] |
| residual before hidden_norm | `norm_before_residual` absent = False | absent = **True** in vLLM | False | False |
| number of aux layers | `num_aux_hidden_states` (else 3) | len(ids) | 3 | 3 |
| more decoder layers | `layers.1.*` ... (plain Llama layers) | same | not served | none |
| EAGLE-3.1 switches | `fc_norm`, `norm_output` (top level); `fc_norm.i.*` | same | refused: varies by release | none |
| MLA layer (model.mla) | `Eagle3DeepseekV3ForCausalLM` (deepseek_v2) | none | `Eagle3DeepseekV2ForCausalLM` | none |

Layer id k means the input of target decoder layer k (eyas, vLLM, speculators, transformers'
`hidden_states[k]`). SGLang adds 1 to the explicit ids it reads from `eagle_config`, so it must be
given k - 1; eyas.model.aux_layers converts, and every export records the convention it wrote.
SGLang skips any tensor name it does not know without a word: a draft saved with
`layers.0.*` names runs there with a random decoder layer. The writers (`eyas.export.writers`)
spell each layout out in full and the readers (`eyas.model.checkpoints`) undo it, so
`import_draft(export_draft(d))` returns identical tensors. DFlash drafts have one layout that vLLM
and SGLang both read (`DFlashDraftModel`); what they read differently is in eyas.export.dflash.
"""

from __future__ import annotations

FORMATS = ("vllm", "sglang", "speculators")  # what eyas writes
LAYOUTS = ("eyas", "vllm", "speculators", "sglang", "eagle")  # what eyas reads
# the first decoder layer's tensor-name prefix in each layout
DECODER_PREFIX = {"eyas": "layers.0.", "vllm": "layers.0.", "speculators": "layers.0.", "sglang": "midlayer.",
                  "eagle": "midlayer."}
