import math
import os

import numpy as np

from ._health import DEFAULT_SATURATION, reports_of

# What each panel shows: (title, function of a report giving one value per head).
METRICS = {
    "max_logit": ("max logit", lambda r: np.asarray(r.max_logit, np.float64)),
    "mean_max_logit": ("mean row max logit", lambda r: np.asarray(r.mean_max_logit, np.float64)),
    "mean_lse": ("mean lse", lambda r: np.asarray(r.mean_lse, np.float64)),
    "saturated": (
        "saturated rows (fraction)",
        lambda r: np.asarray(r.saturated, np.float64) / np.maximum(np.asarray(r.rows), 1),
    ),
    "masked": (
        "masked rows (fraction)",
        lambda r: np.asarray(r.masked, np.float64) / np.maximum(np.asarray(r.rows), 1),
    ),
    "nonfinite": ("non-finite rows", lambda r: np.asarray(r.nonfinite, np.float64)),
    "mean_entropy": (
        "mean entropy (nats)",
        lambda r: np.full(np.shape(r.rows), np.nan)
        if r.mean_entropy is None
        else np.asarray(r.mean_entropy, np.float64),
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


def plot(
    report_or_collection,
    path: str | os.PathLike,
    *,
    metrics: tuple[str, ...] | None = None,
    saturation: float = DEFAULT_SATURATION,
) -> None:
    """Writes a PNG of per-head health heatmaps, layers (rows) by heads (columns).

    One panel per metric; each cell is one head of one layer and is annotated when the grid is
    small. Layers with fewer heads than the widest leave the extra cells blank. Non-finite rows
    are drawn in their own panel so that they stand out. Needs matplotlib
    (`pip install attnaux[plot]`); it is imported only when this function runs.

    **Arguments:**

    - `report_or_collection`: a [`HealthReport`][attnaux.introspect.HealthReport], an
      `AttnAux`, or a mapping `{layer name: HealthReport or AttnAux}` (what
      [`load`][attnaux.introspect.load] returns); auxes are reported with
      [`health`][attnaux.introspect.health] first.
    - `path`: the PNG file to write.
    - `metrics`: which panels, from `"max_logit"`, `"mean_max_logit"`, `"mean_lse"`,
      `"saturated"`, `"masked"`, `"nonfinite"`, `"mean_entropy"`; by default max_logit,
      mean_max_logit, saturated, nonfinite and (when any layer has probabilities) mean_entropy.
    - `saturation`: passed to `health` for auxes.

    **Returns:**

    `None`.

    **Raises:**

    `ImportError` naming `pip install attnaux[plot]` when matplotlib is missing.

    **Example:**

    ```python
    ai.plot(ai.load("step1000.npz"), "heads.png")
    ```
    """
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
    names = list(reports)
    heads = max(int(np.shape(r.rows)[0]) for r in reports.values())
    n_panels = len(metrics)
    cols = min(n_panels, 2)
    rows = math.ceil(n_panels / cols)
    cell_w, cell_h = 0.45, 0.4
    width = max(5.0, 1.8 + heads * cell_w) * cols
    height = max(2.6, 1.4 + len(names) * cell_h) * rows
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    for index, metric in enumerate(metrics):
        ax = axes[index // cols][index % cols]
        title, fn = METRICS[metric]
        grid = np.full((len(names), heads), np.nan)
        for row, name in enumerate(names):
            values = fn(reports[name])
            grid[row, : values.shape[0]] = values
        shown = np.where(np.isfinite(grid), grid, np.nan)
        image = ax.imshow(np.ma.masked_invalid(shown), aspect="auto", cmap="viridis",
                          interpolation="nearest")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        ax.set_title(title)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(heads))
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names)
        if heads * len(names) <= 256:
            for (r, c), value in np.ndenumerate(grid):
                if c < np.shape(reports[names[r]].rows)[0]:
                    text = "nan" if np.isnan(value) else ("-inf" if value == -np.inf else
                                                          f"{value:.3g}")
                    bright = np.isfinite(value) and image.norm(value) > 0.6
                    ax.text(c, r, text, ha="center", va="center", fontsize=7,
                            color="black" if bright else "white")
    for index in range(n_panels, rows * cols):
        axes[index // cols][index % cols].axis("off")
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png", dpi=100)
    plt.close(fig)
