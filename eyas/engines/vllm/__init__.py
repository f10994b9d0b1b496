"""The `vllm` engine: hidden states from vLLM, for targets that need tensor parallelism (`--tp N`).

Two capture paths, chosen by probing the installed vLLM at start (`probe.probe_vllm`):

- `native` (preferred): vLLM's own `extract_hidden_states` speculative method. The target model
  (under TP, on every rank) hands the hidden states at the requested layer ids to a cache-only
  "draft" layer, which writes them into a KV-cache block per token; when a request finishes, the
  KV connector (`connector.EyasHiddenStatesConnector`) reads its blocks and hands them over: TP
  rank 0 passes the states in memory (tp=1, same process) or as one safetensors file per request
  in a private temp folder (tp>1). Layer id N (= num_layers) is the last decoder layer's output
  before the final norm: that is our `final`.
- `hooks` (fallback): forward hooks on the decoder layers of every worker (`worker_hooks`),
  installed through `LLM.collective_rpc`. Used where the native path is missing, and for
  architectures whose vLLM class has no EAGLE-3 aux outputs (Gemma, Phi-3, ...).

Modules: `probe` (the vLLM API each path needs), `connector`, `worker_hooks`, `engine`
(VllmEngine), `runtime` (starting and cleaning up vLLM, shared with generation and eval). None
imports vLLM at import time, so eyas works without it.
"""

from eyas.engines.vllm.engine import VllmEngine

__all__ = ["VllmEngine"]
