"""``perparam finetune --plot PATH.png``: training loss per step, held-out loss at each evaluation, and the
learning rate on a second axis, drawn with matplotlib (the ``plot`` extra: ``pip install 'perparam[plot]'``)
through its non-interactive Agg backend.

The plotted series are also stored in the PNG itself, as JSON in a text chunk named :data:`SERIES_KEY`
(matplotlib's ``savefig(metadata=...)``); :func:`read_series` reads them back, so a test (or a user) checks
the data of a plot, not its pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

from perparam.finetune.errors import FinetuneInputError, write_output

SERIES_KEY = "perparam-series"
INSTALL_HINT = "install the plot extra (pip install 'perparam[plot]', matplotlib) or leave out --plot"


def check_plot_path(path: str | None) -> None:
    """Launcher: a ``.png`` path, and matplotlib importable; that the path can be written is proven with the
    other output paths (``perparam.finetune.cli.check_outputs``)."""
    if not path:
        return
    if Path(path).suffix.lower() != ".png":
        raise FinetuneInputError(f"--plot {path}: the plot is written as PNG; pass a path ending in .png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise FinetuneInputError(f"--plot {path}: matplotlib is not installed: {INSTALL_HINT}") from None


def series(train_losses: list[float], first_step: int, evals: list[tuple[int, float]],
           lrs: list[float]) -> dict[str, list]:
    """The plot's data: ``train_loss`` and ``lr`` as ``[step, value]`` for steps ``first_step + 1 ..``
    (1-based), ``heldout_loss`` as ``[step, nats/token]`` (step 0: before training)."""
    steps = range(first_step + 1, first_step + 1 + len(train_losses))
    return {"train_loss": [[s, x] for s, x in zip(steps, train_losses, strict=True)],
            "heldout_loss": [[s, x] for s, x in evals],
            "lr": [[s, x] for s, x in zip(steps, lrs, strict=True)]}


def write_plot(path: str | Path, data: dict[str, list], title: str = "") -> Path:
    """Draw ``data`` (from :func:`series`) into the PNG at ``path`` (folders created), with the series as
    JSON in its :data:`SERIES_KEY` text chunk; written through a temporary file (``errors.write_output``:
    one-line :class:`FinetuneInputError` naming ``--plot`` if it cannot be)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.add_subplot()
    (train_x, train_y) = zip(*data["train_loss"], strict=True) if data["train_loss"] else ((), ())
    ax.plot(train_x, train_y, color="tab:blue", linewidth=1.2, label="training loss")
    if data["heldout_loss"]:
        eval_x, eval_y = zip(*data["heldout_loss"], strict=True)
        ax.plot(eval_x, eval_y, "o-", color="tab:orange", label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    if data["lr"]:
        lr_x, lr_y = zip(*data["lr"], strict=True)
        lr_ax.plot(lr_x, lr_y, "--", color="tab:green", linewidth=1.0, label="learning rate")
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    handles = ax.get_legend_handles_labels()[0] + lr_ax.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper right")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    out = Path(path)
    metadata = {SERIES_KEY: json.dumps(data)}
    write_output("--plot", out, lambda tmp: fig.savefig(tmp, format="png", metadata=metadata))
    return out


def write_run_plot(path: str | Path, summary: dict) -> Path:
    """The plot of a run from its summary (``train_losses``, ``first_step``, ``heldout_losses``, ``lrs``)."""
    data = series(summary["train_losses"], summary["first_step"], summary["heldout_losses"], summary["lrs"])
    title = f"{summary['model']}: {summary['steps']} steps on {summary['world_size']} ranks"
    return write_plot(path, data, title)


def read_series(path: str | Path) -> dict[str, list]:
    """The series stored in a PNG written by :func:`write_plot`; ``KeyError`` if it has none."""
    from PIL import Image

    with Image.open(path) as image:
        image.verify()  # a valid PNG (raises otherwise)
    with Image.open(path) as image:
        return json.loads(image.text[SERIES_KEY])
