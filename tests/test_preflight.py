"""The preflight check on a real tiny target: the clean hf engine passes, and each fault injected into it
(an off-by-one layer id, the post-norm final state, samples mixed across a batch, another tensor-parallel
rank's tensor, a NaN) fails with its own name; extract, online train and regenerate run it by default and
`--no-preflight` skips it; regenerate's generator check catches a generator that is not the target."""

from __future__ import annotations

import time

import pytest
import torch
import transformers as tf

from eyas.engines.base import FlatCapture, TargetEngine
from eyas.engines.hf import HFEngine
from eyas.engines.preflight import PreflightError, preflight_engine, preflight_samples

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, HIDDEN, LAYERS = 256, 64, 4


@pytest.fixture(scope="module")
def model():
    """A 4-layer random Llama with a non-trivial final norm (so a post-norm state changes the head's argmax)."""
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, initializer_range=0.1, tie_word_embeddings=False)
    m = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.model.norm.weight.uniform_(0.2, 2.0)
    return m


@pytest.fixture(scope="module")
def engine(model):
    eng = HFEngine(model, aux_layer_ids=[1, 2, 3], dtype="float32", device="cpu")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(1)
    return preflight_samples([{"input_ids": torch.randint(0, VOCAB, (n,), generator=g)} for n in (80, 50, 9, 30)])


class Faulty(TargetEngine):
    """The real engine with a fault injected into what it hands back: `fault(flat, batched) -> flat`."""

    name = "hf"

    def __init__(self, inner: TargetEngine, fault, aux_layer_ids=None, tp: int = 1, hide_model: bool = False,
                 greedy=None) -> None:
        self.inner, self.fault, self.tp, self.greedy = inner, fault, tp, greedy
        self.num_layers, self.hidden_size, self.vocab_size = inner.num_layers, inner.hidden_size, inner.vocab_size
        self.aux_layer_ids = list(aux_layer_ids or inner.aux_layer_ids)
        if not hide_model:  # the reference forward then runs on the hf engine's own module
            self.model = inner.model

    def capture(self, seqs):
        return self.capture_flat(seqs).split()

    def capture_flat(self, seqs):
        flat = self.fault(self.inner.capture_flat(seqs), len(seqs) > 1)
        if self.greedy is not None:
            self.last_greedy = [self.greedy(s) for s in seqs]
        return flat

    def target_head(self):
        return self.inner.target_head()


def clean(flat, batched):
    return flat


def post_norm(head):
    return lambda flat, batched: FlatCapture(flat.aux, head.norm(flat.final), flat.cu_seqlens)


def mixed(flat, batched):
    """In a batch, the rows come back in reverse sample order (each sample reads another's offsets)."""
    if not batched:
        return flat
    cu = flat.cu_seqlens
    order = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in reversed(range(len(cu) - 1))])
    return FlatCapture(flat.aux[order], flat.final[order], cu)


def other_rank(flat, batched):
    """Rank 1's copy of an all-gathered tensor: its own shard of the hidden size first."""
    roll = lambda t: torch.cat([torch.roll(c, -HIDDEN // 2, -1) for c in t.split(HIDDEN, -1)], -1)  # noqa: E731
    return FlatCapture(roll(flat.aux), roll(flat.final), flat.cu_seqlens)


def nan(flat, batched):
    aux = flat.aux.clone()
    aux[min(3, len(aux) - 1), HIDDEN + 5] = float("nan")
    return FlatCapture(aux, flat.final, flat.cu_seqlens)


def fails_with(eng, seqs, kind: str, *words: str) -> str:
    with pytest.raises(PreflightError) as e:
        preflight_engine(eng, seqs)
    assert set(e.value.kinds) == {kind}, str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)
    return str(e.value)


def test_clean_engine_passes_quickly(engine, seqs):
    assert len({len(s) for s in seqs}) == len(seqs) == 4 and max(len(s) for s in seqs) <= 64
    t0 = time.perf_counter()
    report = preflight_engine(engine, seqs)
    print(f"\n[preflight] tiny hf target: {time.perf_counter() - t0:.2f} s")
    assert report["reference"] and not report["skipped"]
    preflight_engine(Faulty(engine, clean, tp=2), seqs)  # a faithful tp > 1 engine passes too


def test_off_by_one_layer_id_is_named(model, seqs):
    """The engine captures hidden_states[k+1] for the ids [0, 1, 2] it reports: the classic shift."""
    shifted = HFEngine(model, aux_layer_ids=[1, 2, 3], dtype="float32", device="cpu")
    try:
        msg = fails_with(Faulty(shifted, clean, aux_layer_ids=[0, 1, 2]), seqs, "aux_layer_shift", "off by +1")
        assert "aux layer id 0: the engine's state is hidden_states[1]" in msg
        last = HFEngine(model, aux_layer_ids=[0, 3], dtype="float32", device="cpu")  # id 3 -> the last output
        try:
            fails_with(Faulty(last, lambda f, b: FlatCapture(torch.cat([f.aux[:, :HIDDEN], f.final], -1), f.final,
                                                             f.cu_seqlens)), seqs, "aux_layer_shift",
                       "the last decoder layer's output")
        finally:
            last.close()
    finally:
        shifted.close()


def test_post_norm_final_state_is_named(engine, seqs):
    fails_with(Faulty(engine, post_norm(engine.target_head())), seqs, "final_post_norm", "OUTPUT", "BEFORE the norm")


def test_samples_mixed_across_a_batch_are_named(engine, seqs):
    fails_with(Faulty(engine, mixed), seqs, "batch", "shares a ragged batch", "against the same sample alone")


def test_another_ranks_tensor_is_named(engine, seqs):
    fails_with(Faulty(engine, other_rank, tp=2), seqs, "tp_rank", "tensor parallel 2", "rank 0's")
    # the same states at tp=1 are two plain mismatches (aux states and the head's argmax)
    with pytest.raises(PreflightError) as e:
        preflight_engine(Faulty(engine, other_rank), seqs)
    assert set(e.value.kinds) == {"aux_state", "final_head"}


def test_nan_is_named(engine, seqs):
    fails_with(Faulty(engine, nan), seqs, "nonfinite", "aux layer 2's state of sample 0 (in a batch)", "NaN/inf",
               "token 3")


def test_without_a_reference_the_head_and_norm_signature_still_check_the_final_state(engine, model, seqs):
    """A target too big for a CPU reference (hidden here): the aux check is skipped and says so; the final
    state is checked against the engine's own greedy token and the post-norm signature."""
    greedy = lambda s: int(model(s[None]).logits[0, -1].argmax())  # noqa: E731 - the engine's own greedy token
    report = preflight_engine(Faulty(engine, clean, hide_model=True, greedy=greedy), seqs)
    assert report["skipped"] and "no reference" in report["skipped"][0]
    fails_with(Faulty(engine, post_norm(engine.target_head()), hide_model=True, greedy=greedy), seqs,
               "final_post_norm")
    fails_with(Faulty(engine, other_rank, hide_model=True, greedy=greedy, tp=2), seqs, "tp_rank",
               "the engine's own greedy next token")


def test_stages_run_it_by_default_and_no_preflight_skips_it(engine, tmp_path):
    import numpy as np

    from eyas.recipes.extract import ExtractOptions, run_extract

    class Data:
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(2)
            self.items = [torch.randint(0, VOCAB, (n,), generator=g) for n in (20, 13, 7)]
            self.lengths = np.array([len(s) for s in self.items])

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i):
            return {"input_ids": self.items[i], "loss_mask": torch.ones(len(self.items[i]), dtype=torch.bool)}

    bad = Faulty(engine, mixed)
    bad.config = engine.model.config
    opts = dict(model="tiny", dtype="float32", device="cpu")
    with pytest.raises(PreflightError, match=r"\[batch\]"):
        run_extract(ExtractOptions(out=tmp_path / "s1", **opts), dataset=Data(), engine_obj=bad)
    assert not (tmp_path / "s1").exists()
    run_extract(ExtractOptions(out=tmp_path / "s2", preflight=False, **opts), dataset=Data(), engine_obj=bad)
    assert (tmp_path / "s2" / "manifest.json").is_file()


def test_no_preflight_flag_on_every_stage():
    from typer.testing import CliRunner

    from eyas.cli import app

    for stage in ("extract", "train", "regenerate"):
        out = CliRunner().invoke(app, [stage, "--help"], env={"COLUMNS": "200"}).output
        assert "--no-preflight" in out, stage


def test_online_train_runs_it(tmp_path):
    from _train_utils import AUX, make_prepared, make_target

    from eyas.recipes.train import TrainOptions, run_train

    target, prepared = make_target(tmp_path / "target"), make_prepared(tmp_path / "prepared", n=8)
    eng = HFEngine(str(target), aux_layer_ids=AUX, dtype="float32", device="cpu")
    try:
        with pytest.raises(PreflightError, match=r"\[nonfinite\]"):
            run_train(TrainOptions(out=tmp_path / "run", prepared=prepared, online=True, model=str(target),
                                   device="cpu", max_steps=1), engine=Faulty(eng, nan), log=lambda m: None)
    finally:
        eng.close()


def test_regenerate_checks_the_generators_greedy_replies(tmp_path, smollm2_dir, monkeypatch, capsys):
    """The generator's own greedy tokens against the target's argmax: a generator that maps token ids off by
    one fails before any batch is written; the faithful one passes and says so; --no-preflight skips it."""
    import json

    from transformers import AutoTokenizer

    from eyas.generate.padded import PaddedGenerator
    from eyas.recipes.regenerate import RegenerateOptions, run_regenerate

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    torch.manual_seed(0)
    tiny = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=1, vocab_size=len(tok),
                                              eos_token_id=tok.eos_token_id, initializer_range=0.2)).eval()
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                    {"role": "assistant", "content": "OLD"}]}) + "\n"
                           for q in ("Hi", "What is 2+2?", "Name a color.", "Bye")))

    def regen(out, **kw):
        return run_regenerate(RegenerateOptions(inputs=[str(src)], out=tmp_path / out, max_new_tokens=3,
                                                temperature=0.7, engine="generate", **kw), model=tiny, tokenizer=tok)

    capsys.readouterr()
    regen("clean.jsonl")
    assert "greedy replies to 4 prompts are the target's own next tokens" in capsys.readouterr().err
    decode = PaddedGenerator.decode
    monkeypatch.setattr(PaddedGenerator, "decode", lambda self, prompts, seed: [
        [(t + 1) % len(tok) for t in r] for r in decode(self, prompts, seed)])
    with pytest.raises(PreflightError, match=r"\[generator_greedy\]"):
        regen("bad.jsonl")
    assert not (tmp_path / "bad.jsonl").exists()
    assert regen("skipped.jsonl", preflight=False).is_file()
