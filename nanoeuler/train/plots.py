"""Loss curves as PNG (matplotlib, Agg backend: no display needed): each training stage draws its run's,
and the report and the comparison of experiments reuse the panels."""

from __future__ import annotations

from pathlib import Path


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_losses(runs: list[tuple[str, list[dict]]], out: str | Path) -> Path:
    """One panel per run (title, metrics records): train loss, and val loss where logged.

    Written atomically: the PNG appears complete or not at all.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    runs = [(title, recs) for title, recs in runs if recs] or [("no metrics", [])]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, (title, recs) in zip(axes[0], runs):
        for key, label, style in (("loss", "train", "-"), ("val_loss", "val", "o-")):
            xs, ys = _series(recs, key)
            if xs:
                ax.plot(xs, ys, style, label=label, markersize=3, linewidth=1)
        style_loss_axes(ax, title)
    save_figure(fig, out)
    return out


def style_loss_axes(ax, title: str) -> None:
    """Title, step and loss labels, a light grid and the legend of one loss panel."""
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats, mean over MTP heads)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def save_figure(fig, out: Path) -> None:
    """Lay out, write atomically (a temporary file renamed: the image is complete or absent) and close `fig`.

    The image type follows the name's ending (.png, .pdf, .svg, ...; none: PNG), so `x.pdf` holds a PDF.
    """
    import matplotlib.pyplot as plt

    from nanoeuler.data.common import atomic_path

    try:
        kind = image_type(fig, out)
        fig.tight_layout()
        with atomic_path(out) as tmp:
            fig.savefig(tmp, format=kind, dpi=110)
    finally:
        plt.close(fig)


def image_type(fig, out: Path) -> str:
    """The format matplotlib writes for `out`'s ending; a UserError for one it cannot write."""
    from nanoeuler.errors import UserError

    kind = out.suffix[1:].lower() or "png"
    supported = fig.canvas.get_supported_filetypes()
    if kind not in supported:
        raise UserError(f"plot {out}: cannot write a .{kind} image (use one of .{', .'.join(sorted(supported))})")
    return kind
