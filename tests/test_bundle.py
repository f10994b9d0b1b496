"""`eyas bundle`: a config's target, data and eyas itself packed for an offline node; unpacked elsewhere
from its tar parts, the run there is killed twice and resumed, and ends with the draft a direct run makes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from _eval_utils import save_tiny_chat_target
from safetensors.torch import load_file
from transformers import AutoTokenizer

from eyas.recipes.bundle import BundleOptions, run_bundle
from eyas.recipes.run import load_config, run_pipeline
from eyas.utils.io import EyasError, human_bytes, read_json, sha256_file

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("bundle")
    save_tiny_chat_target(root / "target", AutoTokenizer.from_pretrained(smollm2_dir))
    with open(root / "chats.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Count to {i + 3}, please."},
                                             {"role": "assistant", "content": " ".join(map(str, range(i + 3)))}]})
                    + "\n")
    (root / "questions.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["Count to five."]}) + "\n")
    config = {"target": str(root / "target"), "workdir": str(root / "direct"),
              "prepare": {"inputs": [str(root / "chats.jsonl")], "max_length": 96, "num_workers": 1},
              "extract": {"dtype": "float32", "device": "cpu"},
              "train": {"ttt_steps": 2, "draft_vocab_size": 400, "max_steps": 8, "token_budget": 256,
                        "num_workers": 0, "save_every": 2, "lr": 0.001, "report_to": "none", "device": "cpu"},
              "eval": {"prompts": f"q={root / 'questions.jsonl'}", "max_prompts": 1, "max_turns": 1,
                       "max_new_tokens": 6, "chain": "2", "tree": "none", "device": "cpu"}}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return root, path


def test_a_bundled_run_killed_twice_ends_where_a_direct_run_ends(setup, tmp_path):
    root, config = setup
    run_pipeline(load_config(config), config)
    direct = load_file(str(root / "direct" / "train" / "draft" / "model.safetensors"))

    out = tmp_path / "b"
    run_bundle(BundleOptions(config=config, out=out, workdir=False, part_mb=3, dependencies=False), log=lambda m: None)
    manifest = read_json(out / "manifest.json")
    assert {"config.yaml", "README.md", "assets/target/config.json", "assets/prompts/questions.jsonl"} <= \
        set(manifest["files"]) | {"manifest.json"}
    assert any(name.startswith("wheels/eyas-") and name.endswith(".whl") for name in manifest["files"])
    for name, meta in manifest["files"].items():
        assert sha256_file(out / name) == meta["sha256"], name
    parts = sorted(tmp_path.glob("b.tar.gz.*"))
    assert len(parts) > 1 and all(p.stat().st_size <= 3 << 20 for p in parts)
    index = read_json(tmp_path / "b.parts.json")
    assert [(q["name"], q["bytes"], q["sha256"]) for q in index["parts"]] == \
        [(p.name, p.stat().st_size, sha256_file(p)) for p in parts]
    assert index["env"] == {}  # nothing here is one of eyas' named assets

    node = tmp_path / "node"  # elsewhere: only the parts, their index and the unpack script arrive
    node.mkdir()
    for f in [*parts, tmp_path / "b.parts.json", tmp_path / "b.unpack.py"]:
        (node / f.name).write_bytes(f.read_bytes())
    unpack = [sys.executable, "b.unpack.py", "--no-install"]  # standard library only: no eyas on the path
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    damaged = node / parts[1].name
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    bad = subprocess.run(unpack, cwd=node, env=clean, capture_output=True, text=True)
    assert bad.returncode == 1 and f"part {damaged} is damaged" in bad.stderr and not (node / "b").exists()
    damaged.write_bytes(parts[1].read_bytes())
    done = subprocess.run(unpack, cwd=node, env=clean, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "parts joined, every file checked against manifest.json" in done.stdout
    here = node / "b"
    assert (here / "env.sh").read_text() == ""
    assert yaml.safe_load((here / "config.yaml").read_text())["target"] == "assets/target"
    env = {**os.environ, "EYAS_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "eyas.cli", "run", "config.yaml"]
    rng = random.Random(7)
    for _ in range(2):  # killed at a seeded point, as a time limit kills a job
        proc = subprocess.Popen(cmd, cwd=here, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(8, 25))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    bundled = load_file(str(here / "work" / "train" / "draft" / "model.safetensors"))
    assert set(bundled) == set(direct)
    for k, v in direct.items():
        assert bundled[k].equal(v), k
    taus = [read_json(w / "eval" / "trained" / "report.json")["results"]["all"]["chain-2"]["tau"]
            for w in (root / "direct", here / "work")]
    assert taus[0] == taus[1]


def test_bundle_refuses_what_cannot_travel(setup, tmp_path, monkeypatch):
    root, config = setup
    bad = tmp_path / "hub.yaml"
    bad.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "target": "someorg/not-on-this-disk"}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EyasError, match="'someorg/not-on-this-disk' is not the alias .*nor a hub id in the local"):
        run_bundle(BundleOptions(config=bad, out=tmp_path / "x"), log=lambda m: None)
    assert not (tmp_path / "x").exists()
    with pytest.raises(EyasError, match="--part-mb must be >= 0"):
        BundleOptions(config=config, out=tmp_path / "y", part_mb=-1)


@pytest.mark.parametrize("named", ["alias", "gguf"])
def test_a_gguf_target_travels_as_the_gguf_and_the_total_size_is_printed(setup, tmp_path, named):
    """The alias and a GGUF file travel as the GGUF (a third of the bf16 folder it converts to); on arrival
    it resolves to the same model, and the closing line gives the bundle's total size and each part's."""
    from eyas.assets import resolve_model, smollm2_gguf

    root, config = setup
    gguf = smollm2_gguf()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()),
                                    "target": "smollm2" if named == "alias" else str(gguf)}))
    lines: list[str] = []
    out = tmp_path / "b"
    run_bundle(BundleOptions(config=path, out=out, workdir=False, dependencies=False, part_mb=0), log=lines.append)
    target = yaml.safe_load((out / "config.yaml").read_text())["target"]
    assert target == f"assets/target/{gguf.name}"
    assert sorted(p.name for p in (out / "assets" / "target").iterdir()) == [gguf.name]
    assert sha256_file(out / target) == sha256_file(gguf)
    converted = Path(resolve_model(str(out / target)))
    assert read_json(converted / "config.json") == read_json(Path(resolve_model("smollm2")) / "config.json")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    (line,) = lines
    assets = sum(f.stat().st_size for f in (out / "assets").rglob("*") if f.is_file())
    assert f"{human_bytes(total)} in all (" in line and f"assets/ {human_bytes(assets)}" in line, line


def given_distributions(roots: list[str]) -> list:
    """The installed distributions of `roots` and of all they require here (no extras), found in this venv."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    seen: dict[str, object] = {}
    todo = list(roots)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        dist = seen[name] = distribution(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def node_venv(where: Path, given: list[str]) -> Path:
    """An empty venv (no pip, no setuptools of its own) that also sees `given` (and what they need) as installed,
    through a .pth file naming a folder of links to this venv's copies: the node's own torch and transformers,
    say. This venv's pip works on it with `pip --python`."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where / "node")], check=True,
                   capture_output=True)
    links = where / "given"
    links.mkdir()
    for dist in given_distributions(given):
        for f in dist.files or []:
            top = Path(f).parts[0]
            if top != ".." and not (links / top).exists():
                (links / top).symlink_to(Path(dist.locate_file(top)))
    python = where / "node" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert site != sysconfig.get_paths()["purelib"]
    (Path(site) / "given.pth").write_text(f"{links}\n")
    return python


@pytest.mark.slow  # resolves eyas' tree against PyPI and downloads the missing wheels (a few MiB)
def test_a_bundle_installs_into_an_empty_venv_without_an_index(setup, tmp_path):
    """The node has Python with torch, transformers, datasets and matplotlib (and what they need) and no index:
    the bundle brings exactly the rest, built for the node's Python and platform as named, and `pip install
    --no-index` of it gives a working `eyas`."""
    from packaging.tags import sys_tags

    root, config = setup
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    python = node_venv(tmp_path, ["torch", "transformers", "datasets", "matplotlib"])
    freeze = tmp_path / "node-freeze.txt"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    freeze.write_text(subprocess.run([*pip, "freeze", "--all"], capture_output=True, text=True, check=True,
                                     env=env).stdout)
    has = {line.split("==")[0].lower() for line in freeze.read_text().splitlines()}
    assert "torch" in has and not has & {"gguf", "accelerate"}, has
    platform = next(t.platform for t in sys_tags() if t.platform.startswith("manylinux_2_"))
    out = tmp_path / "b"
    run_bundle(BundleOptions(config=config, out=out, workdir=False, node_packages=freeze, platform=[platform],
                             python_version=f"{sys.version_info.major}.{sys.version_info.minor}"), log=print)
    brought = {p.name.split("-")[0].lower() for p in (out / "wheels").glob("*.whl")}
    assert {"eyas", "gguf", "accelerate"} <= brought and not brought & (has - {"eyas"}), brought
    assert not brought & {"torch", "transformers", "numpy", "datasets", "pyarrow", "matplotlib"}, brought
    assert "accelerate" in (out / "README.md").read_text()
    install = subprocess.run([*pip, "install", "--no-index", "--find-links", str(out / "wheels"), "eyas"],
                             capture_output=True, text=True, env=env, cwd=tmp_path)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    helped = subprocess.run([str(python.parent / "eyas"), "--help"], capture_output=True, text=True, env=env,
                            cwd=tmp_path)
    assert helped.returncode == 0 and "bundle" in helped.stdout, helped.stderr[-2000:]
    where = subprocess.run([str(python), "-c", "import eyas; print(eyas.__file__)"], capture_output=True, text=True,
                           env=env, cwd=tmp_path).stdout
    assert where.startswith(str(tmp_path / "node")), where


def test_named_assets_travel_in_parts_and_the_unpack_script_points_eyas_at_them(setup, tmp_path):
    """The SmolLM2 alias and MT-Bench travel as their files, in parts of at most --part-mb; the unpack script
    joins them and writes env.sh, whose variables make eyas' named assets resolve to the bundle's copies."""
    from eyas.assets import mtbench_path, smollm2_gguf

    root, config = setup
    raw = yaml.safe_load(config.read_text())
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**raw, "target": "smollm2", "eval": {**raw["eval"], "prompts": "mtbench"}}))
    lines: list[str] = []
    run_bundle(BundleOptions(config=path, out=tmp_path / "b", workdir=False, dependencies=False, part_mb=40),
               log=lines.append)
    parts = sorted(tmp_path.glob("b.tar.gz.*"))
    assert len(parts) >= 2 and all(p.stat().st_size <= 40 << 20 for p in parts)
    assert "python3 b.unpack.py" in lines[-1]
    node = tmp_path / "node"
    node.mkdir()
    for f in [*parts, tmp_path / "b.parts.json", tmp_path / "b.unpack.py"]:
        f.rename(node / f.name)
    site = node / "site"  # pip installs eyas' wheel from the bundle alone (--no-index) into a folder of its own
    done = subprocess.run([sys.executable, "b.unpack.py", "--dest", str(node / "here"), f"--pip-arg=--target={site}",
                           "--pip-arg=--no-deps"], cwd=node, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "installed eyas and its wheels" in done.stdout and len(list(site.glob("eyas-*.dist-info"))) == 1
    env = dict(line.removeprefix("export ").split("=", 1) for line in
               (node / "here" / "b" / "env.sh").read_text().splitlines())
    assert set(env) == {"EYAS_SMOLLM2_GGUF", "EYAS_MTBENCH"}
    assert sha256_file(env["EYAS_SMOLLM2_GGUF"]) == sha256_file(smollm2_gguf())
    assert sha256_file(env["EYAS_MTBENCH"]) == sha256_file(mtbench_path())
    shown = subprocess.run([sys.executable, "-c", "from eyas.assets import smollm2_gguf, mtbench_path; "
                            "print(smollm2_gguf()); print(mtbench_path())"], env={**os.environ, **env},
                           capture_output=True, text=True)
    assert shown.stdout.split() == [env["EYAS_SMOLLM2_GGUF"], env["EYAS_MTBENCH"]]


def test_the_node_list_takes_bare_names_and_a_wheel_in_hand_stands_for_what_the_node_lacks(tmp_path):
    """A node list of names alone (versions unknown) still leaves those packages out, and a wheel in hand is
    resolved as its requirements the node lacks: torch's CUDA tree never enters the resolution."""
    import zipfile

    from eyas.utils import wheels

    node = tmp_path / "node.txt"
    node.write_text("torch==2.11.0\nnumpy\n-e git+https://example.invalid/x#egg=y\npyyaml==6.0.1\n")
    pins = wheels.node_pins(node)
    assert pins == {"torch": "2.11.0", "numpy": "", "pyyaml": "6.0.1"}
    whl = tmp_path / "demo-1.0-py3-none-any.whl"
    requires = ["torch>=2.4", "numpy>=1.24", "PyYAML>=6", "pydantic>=2", 'tomli; python_version < "3.11"',
                'pytest; extra == "test"', "nvidia-cudnn-cu13==9.19.0.56"]
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    assert wheels.wheel_requirements(whl, wheels.NodePython("3.12"), pins, with_torch=False) == ["pydantic>=2"]
    older = wheels.wheel_requirements(whl, wheels.NodePython("3.10"), pins, with_torch=True)
    assert older == ["pydantic>=2", 'tomli; python_version < "3.11"', "nvidia-cudnn-cu13==9.19.0.56"]
