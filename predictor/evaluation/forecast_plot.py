"""Picture of a forecaster at work: recent actual demand against its rolling forecasts
(median line, bands up to the upper quantiles), and the forecast beyond the last step."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from predictor.foundation.atomic_files import write_file
from predictor.models.forecast import DemandForecast, quantile_column

MAX_PANELS = 8


def plot_forecasts(
    history: pd.DataFrame,
    rolling: DemandForecast,
    future: DemandForecast,
    path: Path,
    *,
    title: str,
) -> None:
    """One panel per series (at most MAX_PANELS): actual `y` of `history`, the `rolling`
    forecasts (one horizon) as median and quantile bands, and `future` as a fan. Written to
    a temporary file first, then moved into place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = sorted(rolling.frame["unique_id"].unique())[:MAX_PANELS]
    levels = sorted(q for q in rolling.quantiles if q > 0.5)
    fig, axes = plt.subplots(len(series), 1, figsize=(11, 3.2 * len(series)), squeeze=False)
    for ax, uid in zip(axes[:, 0], series, strict=True):
        back = rolling.frame[rolling.frame["unique_id"] == uid]
        ahead = future.frame[future.frame["unique_id"] == uid].sort_values("ds")
        shown = history[(history["unique_id"] == uid) & (history["ds"] >= back["ds"].min())]
        horizon = int(back["horizon"].iloc[0]) if len(back) else 0
        for q, alpha in zip(reversed(levels), (0.18, 0.32, 0.45), strict=False):
            ax.fill_between(
                back["ds"],
                back[quantile_column(0.5)],
                back[quantile_column(q)],
                step="post",
                alpha=alpha,
                color="tab:orange",
                label=f"p50-p{q * 100:g} ({horizon}-step ahead)",
            )
        ax.step(
            back["ds"],
            back[quantile_column(0.5)],
            where="post",
            color="tab:orange",
            lw=1,
            label="median forecast",
        )
        ax.step(shown["ds"], shown["y"], where="post", color="black", lw=1.2, label="actual")
        if len(ahead):
            for q in levels:
                ax.plot(ahead["ds"], ahead[quantile_column(q)], "--", color="tab:red", lw=1)
            ax.plot(
                ahead["ds"],
                ahead[quantile_column(0.5)],
                "o-",
                color="tab:red",
                ms=3,
                label="forecast from the last step",
            )
        ax.set_title(f"{uid}")
        ax.set_ylabel("demand")
        ax.legend(loc="upper left", fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    try:
        write_file(Path(path), lambda temp: fig.savefig(temp, dpi=110, format="png"))
    finally:
        plt.close(fig)
