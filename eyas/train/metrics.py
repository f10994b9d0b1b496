"""Training logs: metrics.jsonl (one JSON line per log step and per validation), TensorBoard and W&B
when installed and wanted, and the one-line summary the progress bar and the log lines show."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eyas.utils.io import EyasError


class MetricsLog:
    """metrics.jsonl (one line per log step; a resume drops lines after its checkpoint), plus
    TensorBoard and W&B when installed and wanted."""

    def __init__(self, out: Path, report_to: str, resume_step: int | None, run_config: dict[str, Any]) -> None:
        self.path = out / "metrics.jsonl"
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        elif self.path.is_file():
            keep = [ln for ln in self.path.read_text().splitlines() if ln.strip()
                    and json.loads(ln).get("step", 0) <= resume_step]
            self.path.write_text("".join(k + "\n" for k in keep))
        self.tb = self.wandb = None
        want_tb = report_to in ("auto", "tensorboard")
        want_wandb = report_to == "wandb" or (report_to == "auto" and os.environ.get("WANDB_PROJECT"))
        if want_tb:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
            except ImportError:
                if report_to == "tensorboard":
                    raise EyasError("--report-to tensorboard needs `pip install tensorboard`") from None
        if want_wandb:
            try:
                import wandb

                self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "eyas"), config=run_config,
                                        dir=str(out), resume="allow")
            except ImportError:
                if report_to == "wandb":
                    raise EyasError("--report-to wandb needs `pip install wandb`") from None

    def write(self, rec: dict[str, Any]) -> None:
        flat = {"train/loss": rec["loss"], "train/tau_sim": rec["tau_sim"], "train/lr": rec["lr"],
                "train/grad_norm": rec["grad_norm"], "train/tok_per_s": rec["tok_per_s"]}
        for j, (a, lo) in enumerate(zip(rec["acc"], rec["step_loss"], strict=True)):
            flat[f"acc/step{j}"], flat[f"loss/step{j}"] = a, lo
        self._record(rec, flat)

    def write_val(self, step: int, m: dict[str, Any]) -> None:
        """A validation record: {"step", "val": {loss, step_loss, acc, tau_sim, valid_tokens, opening}}."""
        flat = {"val/loss": m["loss"], "val/tau_sim": m["tau_sim"]}
        flat.update({f"val/acc/step{j}": a for j, a in enumerate(m["acc"])})
        if "opening" in m:
            flat["val/opening/tau_sim"] = m["opening"]["tau_sim"]
            flat.update({f"val/opening/acc/step{j}": a for j, a in enumerate(m["opening"]["acc"])})
        self._record({"step": step, "val": m}, flat)

    def _record(self, rec: dict[str, Any], flat: dict[str, float]) -> None:
        """One line of metrics.jsonl, and its scalars to TensorBoard / W&B."""
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in flat.items():
                self.tb.add_scalar(k, v, rec["step"])
        if self.wandb is not None:
            self.wandb.log(flat, step=rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def format_info(m: dict[str, Any]) -> str:
    acc = "/".join(f"{a:.2f}" for a in m["acc"])
    line = f"loss {m['loss']:.3f} acc {acc} tau {m['tau_sim']:.2f}"
    if "opening" in m:  # held-out only
        o = m["opening"]
        line += (f"; first {o['tokens']} tokens of first replies ({o['valid_tokens']:,}): acc "
                 + "/".join(f"{a:.2f}" for a in o["acc"]) + f" tau {o['tau_sim']:.2f}")
    return line
