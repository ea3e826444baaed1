"""Weights & Biases as a metrics sink beside metrics.jsonl and TensorBoard (the `wandb` extra).

`wandb_project: ""` keeps W&B out of the run entirely (not even imported). Otherwise process 0
starts one W&B run with the resolved config attached and logs every metrics line at the trainer's
step, and the text TensorBoard gets (samples, episodes) as HTML panels. The W&B run id is kept in <run_dir>/wandb_id, so a resumed run continues the same W&B run;
W&B's steps only grow, so after a resume from an older checkpoint W&B keeps its first values of
the steps run again (resume is exact: they are the same numbers).
"""

from __future__ import annotations

import html
import os

from unitrain.errors import ConfigError

ID_FILE = "wandb_id"


class WandbSink:
    """One W&B run: `log(step, values)` per metrics line, `close()` at the end of training."""

    def __init__(self, cfg):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                f"wandb_project={cfg.wandb_project!r} needs the wandb package: pip install "
                "'unitrain[wandb]' (or wandb_project='' for no W&B)"
            ) from None
        os.makedirs(cfg.run_dir, exist_ok=True)
        id_path = os.path.join(cfg.run_dir, ID_FILE)
        try:
            self.run = wandb.init(
                project=cfg.wandb_project,
                entity=cfg.wandb_entity or None,
                name=cfg.wandb_run_name or cfg.run_name,
                group=cfg.wandb_group or None,
                mode=cfg.wandb_mode,
                dir=cfg.run_dir,
                id=_read(id_path),
                resume="allow",
                config=cfg.to_dict(),
            )
        except wandb.Error as e:  # no login, unreachable server, bad entity: the user's to fix
            raise ConfigError(
                f"W&B could not start a run for wandb_project={cfg.wandb_project!r}: {e} "
                "(log in with `wandb login`, or set wandb_mode=offline)"
            ) from None
        if cfg.wandb_mode != "disabled" and not os.path.exists(id_path):
            _write(id_path, self.run.id)

    def log(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        """Markdown text (sampled completions, whole episodes) as a W&B HTML panel, verbatim."""
        import wandb

        self.run.log({tag: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def close(self) -> None:
        self.run.finish()


def _read(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
