import math
import os

import numpy as np

from ._health import DEFAULT_SATURATION, reports_of

# The file formats `plot` writes, by extension (matplotlib draws each without extra packages).
FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def _fraction(count, rows):
    return np.asarray(count, np.float64) / np.maximum(np.asarray(rows), 1)


# What each panel shows: (title, function of a report giving one value per head, or None when
# the report does not hold that metric).
METRICS = {
    "max_logit": ("max logit", lambda r: np.asarray(r.max_logit, np.float64)),
    "mean_max_logit": ("mean row max logit", lambda r: np.asarray(r.mean_max_logit, np.float64)),
    "mean_lse": ("mean lse", lambda r: np.asarray(r.mean_lse, np.float64)),
    "saturated": ("saturated rows (fraction)", lambda r: _fraction(r.saturated, r.rows)),
    "masked": ("masked rows (fraction): no visible key",
               lambda r: _fraction(r.masked, r.rows)),
    "nonfinite": ("non-finite rows: lse or max NaN or +inf",
                  lambda r: np.asarray(r.nonfinite, np.float64)),
    "mean_entropy": (
        "mean entropy (nats)",
        lambda r: None if r.mean_entropy is None else np.asarray(r.mean_entropy, np.float64),
    ),
}
DEFAULT_METRICS = ("max_logit", "mean_max_logit", "saturated", "nonfinite", "mean_entropy")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "attnaux.introspect.plot needs matplotlib, which is not installed. Install it with "
            "`pip install attnaux[plot]` (or `pip install matplotlib`)."
        ) from error
    return plt


def _file_format(path) -> str:
    """The format `plot` writes to `path`, from its extension; a ValueError for any other."""
    name = os.fspath(path)
    suffix = os.path.splitext(name)[1]
    if suffix.lower() not in FORMATS:
        raise ValueError(
            f"plot() cannot write {name!r}: it writes {', '.join(FORMATS)} files, chosen by the "
            f"extension, and this path has {f'the extension {suffix!r}' if suffix else 'none'}."
        )
    return FORMATS[suffix.lower()]


def _fmt(value: float) -> str:
    if np.isnan(value):
        return "nan"
    if np.isinf(value):
        return "-inf" if value < 0 else "inf"
    return f"{value:.3g}"


def _saturation_note(reports) -> str:
    levels = sorted({float(r.saturation) for r in reports.values()})
    if len(levels) != 1:
        return "saturated: lse - max < the report's saturation (top probability near 1)"
    s = levels[0]
    return f"saturated: top probability > {math.exp(-s):.3g} (lse - max < {s:g})"


def plot(
    report_or_collection,
    path: str | os.PathLike,
    *,
    metrics: tuple[str, ...] | None = None,
    saturation: float = DEFAULT_SATURATION,
    clip_threshold: float | None = None,
    title: str | None = None,
) -> None:
    """Writes per-head health heatmaps, layers (rows) by heads (columns), to a PNG (or SVG, PDF).

    One panel per metric; each cell is one head of one layer and is annotated when the grid is
    small. Layers with fewer heads than the widest leave the extra cells blank; a layer whose
    aux holds no probabilities shows "n/a" in the entropy panel. A panel whose value is the same
    in every head (say, no non-finite rows) gets no colour bar: its title gives the value.
    "Saturated" rows are near one-hot ones (defined on the panel). Needs matplotlib
    (`pip install attnaux[plot]`); it is imported only when this function runs.

    **Arguments:**

    - `report_or_collection`: a [`HealthReport`][attnaux.introspect.HealthReport], an
      `AttnAux`, or a mapping `{layer name: HealthReport or AttnAux}` (what
      [`load`][attnaux.introspect.load] returns); auxes are reported with
      [`health`][attnaux.introspect.health] first.
    - `path`: the file to write; its extension picks the format: `.png`, `.svg` or `.pdf`.
    - `metrics`: which panels, from `"max_logit"`, `"mean_max_logit"`, `"mean_lse"`,
      `"saturated"`, `"masked"`, `"nonfinite"`, `"mean_entropy"`; by default max_logit,
      mean_max_logit, saturated, nonfinite and (when any layer has probabilities) mean_entropy.
    - `saturation`: passed to `health` for auxes.
    - `clip_threshold`: a QK-clip threshold to mark on the max logit panel (on its colour bar,
      and an outline on every head above it), or `None`.
    - `title`: the figure's title; by default "Attention health per head".

    **Returns:**

    `None`.

    **Raises:**

    `ValueError` for a path whose extension is not `.png`, `.svg` or `.pdf` (before any work),
    an empty collection or unknown metrics; `ImportError` naming `pip install attnaux[plot]`
    when matplotlib is missing.

    **Example:**

    ```python
    ai.plot(ai.load("step1000.npz"), "heads.png", clip_threshold=100.0)
    ```
    """
    file_format = _file_format(path)
    if clip_threshold is not None and (
        isinstance(clip_threshold, bool)
        or not isinstance(clip_threshold, (int, float, np.integer, np.floating))
        or not math.isfinite(clip_threshold)
    ):
        raise ValueError(f"`clip_threshold` must be a finite number or None; got "
                         f"{clip_threshold!r}.")
    reports = reports_of(report_or_collection, saturation=saturation)
    if not reports:
        raise ValueError("plot() got an empty collection; there is nothing to draw.")
    if metrics is None:
        metrics = tuple(
            m for m in DEFAULT_METRICS
            if m != "mean_entropy" or any(r.mean_entropy is not None for r in reports.values())
        )
    unknown = [m for m in metrics if m not in METRICS]
    if unknown or not metrics:
        raise ValueError(
            f"`metrics` must be a non-empty tuple of {', '.join(map(repr, METRICS))}; got "
            f"{metrics!r}."
        )
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Rectangle

    names = list(reports)
    heads = max(int(np.shape(r.rows)[0]) for r in reports.values())
    n_panels = len(metrics)
    cols = min(n_panels, 2)
    rows = math.ceil(n_panels / cols)
    cell_w, cell_h = 0.45, 0.4
    width = max(5.5, 1.8 + heads * cell_w) * cols
    panel_h = max(2.8, 1.7 + len(names) * cell_h)
    height = panel_h * rows + 1.1
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    annotate = heads * len(names) <= 256
    for index, metric in enumerate(metrics):
        ax = axes[index // cols][index % cols]
        label, fn = METRICS[metric]
        grid = np.full((len(names), heads), np.nan)
        exists = np.zeros((len(names), heads), bool)  # the layer has this head
        missing = np.zeros((len(names), heads), bool)  # ... but not this metric
        for row, name in enumerate(names):
            n_heads = int(np.shape(reports[name].rows)[0])
            exists[row, :n_heads] = True
            values = fn(reports[name])
            if values is None:
                missing[row, :n_heads] = True
            else:
                grid[row, :n_heads] = values
        finite = np.isfinite(grid)
        constant = not finite.any() or np.ptp(grid[finite]) == 0
        notes = []
        if constant:
            # One colour carries no information: a flat grey and the value in the title.
            image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest",
                              cmap=ListedColormap(["#e4e4e4"]))
            if finite.any():
                label = f"{label}: {_fmt(grid[finite][0])} in every head"
        else:
            image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis",
                              interpolation="nearest")
            colorbar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        if metric == "saturated":
            notes.append(_saturation_note(reports))
        if metric == "mean_entropy" and missing.any():
            notes.append("n/a: the aux holds no probabilities (return_probs=False)")
        if metric == "max_logit" and clip_threshold is not None:
            above = exists & ~missing & (grid > clip_threshold)
            count = int(above.sum())
            note = f"QK-clip threshold {clip_threshold:g}"
            if not constant:
                low, high = colorbar.mappable.get_clim()
                if low <= clip_threshold <= high:
                    colorbar.ax.axhline(clip_threshold, color="red", linewidth=2)
                    note += " (red line on the colour bar)"
            notes.append(note)
            notes.append(f"{count} of {int(exists.sum())} heads above it, outlined red" if count
                         else "every head at or below it")
            for r, c in zip(*np.nonzero(above)):
                ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red",
                                       linewidth=2.5, label="above the QK-clip threshold"))
        for r, c in zip(*np.nonzero(missing)):
            ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, facecolor="#f0f0f0",
                                   edgecolor="#b0b0b0", hatch="///", linewidth=0))
        ax.set_title(label + "".join(f"\n{note}" for note in notes), fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(heads))
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names)
        if annotate:
            for (r, c), value in np.ndenumerate(grid):
                if not exists[r, c]:
                    continue
                if missing[r, c]:
                    text, color = "n/a", "black"
                else:
                    text = _fmt(value)
                    dark = np.isfinite(value) and not constant and image.norm(value) <= 0.6
                    color = "white" if dark else "black"
                ax.text(c, r, text, ha="center", va="center", fontsize=7, color=color)
    for index in range(n_panels, rows * cols):
        axes[index // cols][index % cols].axis("off")
    fig.suptitle(title if title is not None else "Attention health per head", fontsize=12)
    fig.text(0.5, 0.01, "Each cell: one head of one layer, summarised over all of its softmax "
             "rows (every query position of every batch element).", ha="center", va="bottom",
             fontsize=8, color="#444444")
    fig.tight_layout(rect=(0, 0.4 / height, 1, 1))
    fig.savefig(os.fspath(path), format=file_format, dpi=100)
    plt.close(fig)
