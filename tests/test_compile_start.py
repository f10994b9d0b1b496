"""The draft compiled in the background while the first steps run eagerly (eyas.train.compiling): the same
training as compiling it first, and the compiled code takes over once built."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from eyas.engines.head import TargetHead
from eyas.model.config import DraftConfig
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.vocab import build_draft_vocab
from eyas.train.config import TrainConfig
from eyas.train.distributed import DistInfo
from eyas.train.trainer import Trainer
from eyas.train.ttt import summarize

pytestmark = pytest.mark.usefixtures("one_thread")

T, V, H = 64, 96, 32


def batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    docs = torch.tensor([0] * 40 + [1] * 24)
    pos = torch.cat([torch.arange(40), torch.arange(24)])
    return {"input_ids": torch.randint(0, V, (T,), generator=g), "loss_mask": pos >= 4, "position_ids": pos,
            "document_ids": docs, "aux_hidden": torch.randn(T, 3 * H, generator=g),
            "final_hidden": 3 * torch.randn(T, H, generator=g), "multi_doc": True, "num_tokens": T}


def train(background: bool, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor], Trainer]:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=V, draft_vocab_size=48, target_hidden_size=H, aux_layer_ids=[0, 1, 2], fc_norm=True,
                      norm_output=True)
    draft = Eagle3Draft(cfg)
    draft.set_vocab(*build_draft_vocab(torch.arange(V, 0, -1), 48))
    head = TargetHead(torch.empty(0), torch.ones(H), torch.randn(V, H, generator=torch.Generator().manual_seed(1)),
                      1e-5)
    tc = TrainConfig(ttt_steps=3, token_budget=T, dtype="fp32", compile=True, compile_in_background=background,
                     attention="math", lr=1e-2, warmup_steps=1)
    trainer = Trainer(tc, draft, head, DistInfo(device=torch.device("cpu")), total_steps=10)
    losses = []
    for i in range(steps):
        losses.append(summarize(trainer.train_step([batch(i)]), trainer.weights)["loss"])
        if background and i == 0:
            trainer.background.wait()
    return losses, {k: v.detach().clone() for k, v in trainer.draft.state_dict().items()}, trainer


def test_compiling_in_the_background_trains_as_compiling_first():
    """Step 1 runs eagerly while nothing is compiled; a thread then builds the layer's halves, the final norm
    and the loss chunk (forward and backward) without touching a gradient, and steps 2-3 run that code with
    no compile of their own: losses and weights match a run compiled before its first step."""
    first, first_state, upfront = train(background=False)
    assert upfront.background is None and counters["stats"]["unique_graphs"] == 4
    losses, state, trainer = train(background=True)
    parts = trainer.background.parts
    assert [p.name for p in parts] == ["layers.0.attention_inputs", "layers.0.finish", "norm", "loss"]
    assert trainer.compile_ready() and all(p.ready and p.compiled is not None for p in parts)
    built = counters["stats"]["unique_graphs"]
    assert built == 4 and counters["aot_autograd"]["total"] == 4  # the three halves' backward included
    assert losses == pytest.approx(first, rel=1e-5)
    for k, v in first_state.items():
        assert torch.allclose(state[k], v, rtol=1e-4, atol=1e-5), k  # Adam at lr 1e-2: updates of ~1e-2
    assert all(p.grad is None for p in trainer.draft.parameters())  # the thread left no gradient behind
    train_more = trainer.train_step([batch(9)])
    assert counters["stats"]["unique_graphs"] == built and torch.isfinite(train_more).all()  # nothing recompiled


def test_a_part_that_fails_to_compile_in_the_background_runs_eagerly():
    from eyas.train.compiling import Background, CompiledOrEager

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(x).sum() * 0 + x.sum()

    bg = Background()
    part = bg.add(CompiledOrEager(f, "f", deferred=True))
    part.compiled = lambda *a: (_ for _ in ()).throw(RuntimeError("compiler bug"))
    x = torch.ones(3)
    assert part(x).item() == 3.0 and not bg.ready
    with pytest.warns(UserWarning, match="torch.compile of f failed"):
        bg.start()
        bg.wait()
    assert bg.ready and part.compiled is None and part(x).item() == 3.0


class _Graph:
    """What GraphedStep does with a captured graph: replay it."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def replay(self) -> None:
        self.events.append("replay")


def test_the_step_is_captured_only_once_the_compiled_code_has_run_warmup_steps(monkeypatch):
    """GraphedStep's order (CUDA's own pieces stood in for: there is no GPU here): eager steps while the draft
    compiles in the background, then `warmup` steps of the compiled code, then the capture, then replays."""
    from eyas.train.graphed import GraphedStep

    events: list[str] = []
    compiled = {"ready": False}
    step = GraphedStep(lambda micro, mask: torch.zeros(2, 3), lambda b: b, opt=None, model=None,
                       device=torch.device("cpu"), flex=False, host_embeds=False, warmup=2,
                       ready=lambda: compiled["ready"])

    def capture() -> None:
        events.append("capture")
        step.graph, step.stats = _Graph(events), torch.zeros(2, 3)

    monkeypatch.setattr(step, "_load", lambda batch: True)
    monkeypatch.setattr(step, "_on_side_stream", lambda fn: events.append("eager") or fn())
    monkeypatch.setattr(step, "_capture", capture)
    for _ in range(5):
        step({})
    assert events == ["eager"] * 5  # compiling in the background: no capture, however many steps
    compiled["ready"] = True
    for _ in range(4):
        step({})
    assert events == ["eager"] * 7 + ["capture", "replay", "replay"]
