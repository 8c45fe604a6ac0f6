"""matplotlib, headless, for the PNGs the commands write."""
from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish(fig, axes, path):
    """Grid and legend on ``axes``, then write ``fig`` to ``path`` (PNG, 120 dpi) and close it."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
