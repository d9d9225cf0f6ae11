"""The benchmarks' PNG plots: one figure with one axes, on the Agg back end, or None (with a note) when matplotlib is
not installed, so a benchmark never fails for want of a plot."""


def new_axes(figsize=(7, 4.5)):
    """(figure, axes), or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print('no matplotlib: PNG skipped')
        return None
    return plt.subplots(figsize=figsize)
