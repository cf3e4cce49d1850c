"""Where a run's metrics go: ``MetricsLog`` (metrics.jsonl in the run directory, one line per step), its
loss curve (``plot_losses``: loss.png) and the optional sinks beside them: TensorBoard
(``logging.tensorboard=true``) and Weights & Biases (``logging.wandb.project=NAME``, offline by default:
no network, ``wandb sync`` later). Neither package is required unless its sink is switched on; a
missing one is a clear error before training.

Example::

    sinks = Trackers.from_config(cfg, out, resume_step=0)
    sinks.log({"step": 1, "loss": 2.3, "lr": 1e-4})
    sinks.close()
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from slimtune.errors import SlimtuneError
from slimtune.fileio import os_errors, write_atomic

TENSORBOARD_DIR = "tensorboard"


class Trackers:
    """Every enabled sink; ``log`` sends the numeric fields of a metrics record under ``train/``/``eval/``."""

    def __init__(self, tensorboard=None, wandb_run=None):
        self.tensorboard = tensorboard
        self.wandb_run = wandb_run

    @classmethod
    def from_config(cls, cfg, out: Path, resume_step: int) -> Trackers:
        tensorboard = wandb_run = None
        if cfg.logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional: logging.tensorboard only
            except ImportError:
                raise SlimtuneError("logging.tensorboard=true needs the tensorboard package: pip install 'slimtune[tensorboard]'") from None
            # purge_step: events past the resumed step (written before a kill) are dropped, as in metrics.jsonl
            tensorboard = SummaryWriter(log_dir=str(out / TENSORBOARD_DIR), purge_step=resume_step + 1 if resume_step else None)
        if cfg.logging.wandb.project is not None:
            try:
                import wandb  # optional: logging.wandb only
            except ImportError:
                raise SlimtuneError("logging.wandb.project needs the wandb package: pip install 'slimtune[wandb]'") from None
            os.environ.setdefault("WANDB_SILENT", "true")
            run_id = hashlib.sha256(str(out).encode()).hexdigest()[:16]  # one W&B run per output_dir: resume continues it
            try:
                wandb_run = wandb.init(
                    project=cfg.logging.wandb.project,
                    dir=str(out),
                    mode=cfg.logging.wandb.mode,
                    id=run_id,
                    resume="allow",
                    config=dict(cfg.values),
                    settings=wandb.Settings(console="off", x_disable_stats=True),
                )
            except Exception as e:  # wandb raises its own error types (no login for online mode, ...)
                raise SlimtuneError(
                    f"wandb.init failed for project {cfg.logging.wandb.project!r}: {' '.join(str(e).split())[:300]}"
                ) from None
        return cls(tensorboard, wandb_run)

    def log(self, record: dict) -> None:
        step = record["step"]
        scalars = {}
        for key, value in record.items():
            if key in ("step", "epoch") or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            scalars[f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"] = value
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
            for sample in record.get("samples", []):
                self.tensorboard.add_text("samples", f"**{sample['prompt']}**\n\n{sample['text']}", step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


class MetricsLog:
    """metrics.jsonl, one line per optimizer step. On resume, lines past the checkpoint's step (written
    before the previous process stopped) are dropped, so the file describes one continuous run; the
    checkpoint step's own line, if a kill took it, is written back from ``last_record`` (the record the
    recipe state carries)."""

    def __init__(self, path: Path, keep_through_step: int, last_record: dict | None = None):
        self.path = path
        kept, steps = [], set()
        if keep_through_step and path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    step = json.loads(line)["step"]
                    if step <= keep_through_step:
                        kept.append(line)
                        steps.add(step)
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut short by a kill
        if keep_through_step and keep_through_step not in steps and last_record is not None:
            kept.append(json.dumps(last_record))
        with os_errors("write", path.with_name(path.name + ".partial")):
            write_atomic(path, "".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        with os_errors("write", self.path), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def plot_losses(metrics_path: Path, png_path: Path) -> Path | None:
    """The loss curve of the whole run from metrics.jsonl as a PNG: train loss per step, eval loss where
    evaluated, the learning rate, checkpoints (dotted) and resumes (dashed), integer step ticks. None
    when metrics.jsonl has no line.

    Example: ``plot_losses(Path("run/metrics.jsonl"), Path("run/loss.png"))``"""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    from matplotlib.figure import Figure  # no pyplot: no global backend state
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], color="tab:blue", linewidth=1.2, label="train loss")
    evaluated = [r for r in rows if "eval_loss" in r]
    if evaluated:
        eval_steps, eval_losses = [r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated]
        ax.plot(eval_steps, eval_losses, "o-", color="tab:green", markersize=3, label="eval loss")
    for r in rows:
        if "checkpoint" in r:
            ax.axvline(r["step"], color="0.8", linewidth=0.8, linestyle=":")
        if "resumed_from" in r:
            ax.axvline(r["resumed_from"] + 0.5, color="tab:red", linewidth=1.0, linestyle="--", label="resumed")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax.legend(loc="upper right", fontsize=8)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, [r["lr"] for r in rows], color="tab:orange", linewidth=1.0, alpha=0.7)
    lr_ax.set_ylabel("learning rate", color="tab:orange")
    ax.set_title(f"{metrics_path.parent.name}: loss per step (dotted: checkpoints, dashed: resumed)")
    fig.tight_layout()
    with os_errors("write the loss curve", png_path):
        write_atomic(png_path, fig.savefig, suffix=".partial.png")  # the suffix tells matplotlib the format
    return png_path
