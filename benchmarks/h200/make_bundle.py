"""Bundle the embedded default's assets for a GPU box that has none of the asset packages.

A device call carries at most 64 MiB, so the bundle comes in two folders, one per call:
  BUNDLE/a: the first half of SmolLM2's GGUF, ShareGPT with the assistant replies blanked (they are
            rewritten by the target anyway; 5 MB as .xz) and MT-Bench's question.jsonl;
  BUNDLE/b: the second half of the GGUF and the `gguf` wheel (transformers reads GGUF through it).

    python3 benchmarks/h200/make_bundle.py --out .gpu      # then carry .gpu/a, then .gpu/b (see call*.sh)
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from eyas.assets import mtbench_path, sharegpt_path, smollm2_gguf
from eyas.data.readers import iter_json_array


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(".gpu"))
    args = ap.parse_args()
    a, b = args.out / "a", args.out / "b"
    a.mkdir(parents=True, exist_ok=True)
    b.mkdir(parents=True, exist_ok=True)

    gguf = smollm2_gguf().read_bytes()
    half = len(gguf) // 2 + 1
    (a / "gguf.part00").write_bytes(gguf[:half])
    (b / "gguf.part01").write_bytes(gguf[half:])

    kept = skipped = 0
    with lzma.open(a / "sharegpt_users.jsonl.xz", "wt", encoding="utf-8") as f:
        for row in iter_json_array(sharegpt_path()):
            if row.skip:
                skipped += 1
                continue
            msgs = [{"role": m["role"], "content": "-" if m["role"] == "assistant" else m["content"]}
                    for m in row.messages]
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
            kept += 1
    shutil.copy(mtbench_path(), a / "question.jsonl")

    wheel = f"gguf=={version('gguf')}"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", wheel, "-d", str(b)], check=True)
    sizes = {p.relative_to(args.out).as_posix(): p.stat().st_size for p in sorted(args.out.glob("[ab]/*"))}
    print(f"{kept} conversations ({skipped} unusable records skipped); files: {sizes}")
    for folder in (a, b):
        total = sum(p.stat().st_size for p in folder.iterdir())
        assert total < 60 * 2**20, f"{folder} is {total / 2**20:.0f} MiB: over one call's carry"


if __name__ == "__main__":
    main()
