"""Draw a Timeline: a row per rank, time left to right, a cell per pass.

Only the Timeline format is read, so a simulated schedule (unit costs) and a traced real run
(seconds) are drawn the same way. Colour tells the pass kind, light/dark shade the rank's first
or second chunk, the label its micro-batch; grey is idle. Passes that ran as one unit share a
black border. With `focus_iteration` the window is that iteration's span and the cells of the
neighbouring iterations that intrude (interlocking schedules) are drawn faded.
"""

import matplotlib

matplotlib.use('Agg')  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from schedules.passes import KINDS  # noqa: E402

# (light, dark) per kind: first chunk light, second chunk dark.
COLOURS = {
    'F': ('#9ecae1', '#2171b5'),
    'B': ('#fdae6b', '#d94801'),
    'W': ('#a1d99b', '#238b45'),
    'BW': ('#bcbddc', '#6a51a3'),
}
KIND_NAMES = {'F': 'forward', 'B': 'backward (inputs)', 'W': 'backward (weights)', 'BW': 'backward'}
IDLE = '#d9d9d9'
FADE = 0.7  # neighbouring iterations: colours mixed this far towards white (opaque, so idle grey stays apart)


def _colour(p, faded=False):
    light, dark = COLOURS.get(p.kind, ('#cccccc', '#666666'))
    colour = to_rgb(light if p.chunk % 2 == 0 else dark)
    return tuple(c + (1 - c) * FADE for c in colour) if faded else colour


def _label(p):
    return str(p.micro_batch) + ("'" if p.direction else '')


def plot_timeline(timeline, path=None, title=None, reference_end=None, reference_label='1F1B ends',
                  focus_iteration=None, ax=None):
    """Render `timeline`; save to `path` if given. Returns the matplotlib Figure.

    reference_end: time (relative to the window start) of a dashed vertical line, e.g. where the
    1F1B schedule of the same P and M ends. focus_iteration: draw that iteration in full colour
    and clip to its span; other iterations fade.
    """
    t0, t1 = timeline.span(focus_iteration)
    length = max(t1 - t0, 1e-9)
    ranks = timeline.num_ranks
    if ax is None:
        width = min(max(10.0, 0.32 * length), 30.0) if timeline.units == 'F' else 14.0
        fig, ax = plt.subplots(figsize=(width, 0.55 * ranks + 1.6))
    fig = ax.figure
    height = 0.8

    # Cell widths in points, to size the labels so they fit.
    fig.canvas.draw()
    axis_points = ax.get_window_extent().width * 72 / fig.dpi

    kinds, chunks, any_faded = set(), set(), False
    for rank, row in enumerate(timeline.ranks):
        y = ranks - 1 - rank  # rank 0 on top
        ax.add_patch(Rectangle((0, y - height / 2), length, height, facecolor=IDLE, edgecolor='none', zorder=0))
        pairs = {}
        for p in row:
            if p.end <= t0 or p.start >= t1:
                continue
            faded = focus_iteration is not None and p.iteration != focus_iteration
            any_faded |= faded
            start, end = max(p.start, t0) - t0, min(p.end, t1) - t0
            ax.add_patch(Rectangle((start, y - height / 2), end - start, height, facecolor=_colour(p, faded),
                                   edgecolor='white', linewidth=0.6, zorder=1))
            if not faded:
                kinds.add(p.kind)
                chunks.add(p.chunk % 2)
            cell_points = (end - start) / length * axis_points
            size = min(8.0, cell_points / max(len(_label(p)), 1) * 0.9)
            if size >= 4:
                dark = p.chunk % 2 == 1 and not faded
                ax.text((start + end) / 2, y, _label(p), ha='center', va='center', fontsize=size,
                        color='white' if dark else '#999999' if faded else 'black', zorder=3)
            if p.pair is not None:
                lo, hi = pairs.get((p.iteration, p.pair), (start, end))
                pairs[(p.iteration, p.pair)] = (min(lo, start), max(hi, end))
        for lo, hi in pairs.values():  # one border around the passes run as a unit
            ax.add_patch(Rectangle((lo, y - height / 2), hi - lo, height, fill=False, edgecolor='black',
                                   linewidth=1.4, zorder=2))

    handles = []
    for kind in KINDS:
        if kind in kinds:
            for c in sorted(chunks):
                suffix = f' (chunk {c})' if len(chunks) > 1 else ''
                handles.append(Patch(facecolor=COLOURS[kind][c], label=KIND_NAMES[kind] + suffix))
    handles.append(Patch(facecolor=IDLE, label='idle'))
    if reference_end is not None:
        ax.axvline(reference_end, color='black', linestyle='--', linewidth=1.2, zorder=4)
        handles.append(plt.Line2D([], [], color='black', linestyle='--', label=reference_label))
    if any_faded:
        faded = tuple(c + (1 - c) * FADE for c in to_rgb(COLOURS['F'][1]))
        handles.append(Patch(facecolor=faded, label='neighbouring iterations (faded)'))

    right = max(length, reference_end or 0) * 1.01
    ax.set_xlim(0, right)
    ax.set_ylim(-0.6, ranks - 0.4)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f'rank {ranks - 1 - y}' for y in range(ranks)])
    ax.set_xlabel('time (forward units)' if timeline.units == 'F' else f'time ({timeline.units})')
    if title:
        ax.set_title(title, fontsize=10, loc='left')
    ax.legend(handles=handles, loc='upper left', bbox_to_anchor=(0, -0.32 if ranks < 4 else -0.18),
              ncol=min(len(handles), 4), fontsize=8, frameon=False)
    for side in ('top', 'right', 'left'):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120, bbox_inches='tight')
        plt.close(fig)
    return fig


def plot_measured_vs_predicted(measured, predicted, path, title=''):
    """A traced step (top) and the simulator's prediction of it (bottom), on one time scale."""
    _, span = measured.span()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 1.2 * measured.num_ranks * 2 + 2))
    plot_timeline(measured, ax=top, title=f"{title}measured step: {span * 1e3:.1f} ms")
    plot_timeline(predicted.timeline, ax=bottom,
                  title=f"{title}simulated from the measured costs: {predicted.makespan * 1e3:.1f} ms")
    for ax in (top, bottom):
        ax.set_xlim(0, max(span, predicted.makespan))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
