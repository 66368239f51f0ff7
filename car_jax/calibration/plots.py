"""Reliability diagram (host). Figures are built with matplotlib's object API
(`matplotlib.figure.Figure`, rendered by Agg when saved): no pyplot, no global backend
switch, no display needed."""
from __future__ import annotations

import os

import numpy as np
from matplotlib.figure import Figure

from car_jax.calibration import metrics


def reliability_diagram(correct, confidence, path: str | os.PathLike, n_bins: int = 10,
                        title: str | None = None) -> str:
    """Writes a PNG reliability diagram of bool[B] correctness against float[B] confidence.

    Bars: accuracy per confidence bin (car_jax's bins, see `car_jax.calibration.metrics`), with the gap to
    the bin's mean confidence shaded and the bin count written above each bar; the diagonal is
    perfect calibration; ECE and B go in the title. Empty bins draw no bar. Returns the path.
    """
    c, q = metrics.check_inputs(correct, confidence)
    count, mean_q, acc = (np.asarray(a) for a in metrics.bin_stats(c, q, n_bins))
    ece = metrics.calibration_arrays(c, q, n_bins)["ece"].item()
    edges = metrics.bin_edges(n_bins)
    left, width = edges[:-1], np.diff(edges)
    full = count > 0

    fig = Figure(figsize=(4.5, 4.5), dpi=120)
    ax = fig.subplots()
    ax.bar(left[full], acc[full], width[full], align="edge", color="tab:blue",
           edgecolor="black", label="accuracy")
    ax.bar(left[full], mean_q[full] - acc[full], width[full], bottom=acc[full], align="edge",
           color="tab:red", alpha=0.3, edgecolor="tab:red", hatch="//", label="gap to mean q")
    for x, w, a, n in zip(left[full], width[full], np.maximum(acc, mean_q)[full], count[full]):
        ax.text(x + w / 2, min(a + 0.02, 0.97), str(int(n)), ha="center", fontsize=7)
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence q", ylabel="accuracy",
           title=(title + "\n" if title else "") + f"ECE {ece:.3f}, B = {c.size}")
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return str(path)
