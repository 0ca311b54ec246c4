"""Draw every registered pipeline schedule at one P (ranks) and M (micro-batches), one PNG each.

    python scripts/plot_schedules.py --stages 4 --micro-batches 8 --out plots/

A dashed line marks where 1F1B ends for the same P and M. Schedules whose iterations interlock
(back to back, the next one starts before the last has ended everywhere) are drawn from a
chained run, one iteration in full colour and its neighbours faded.
"""

import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs its accelerator notice to stdout on import
    from schedules.observe.plot import plot_timeline
    from schedules.registry import available_schedules
    from schedules.simulator.simulate import simulate


def main():
    parser = common.add_point(common.parser(__doc__))
    parser.add_argument('--out', required=True, help='directory for the PNG files')
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    P, M = args.stages, args.micro_batches

    reference = simulate('1f1b', P, M, latency=args.latency, iterations=1).makespan
    for name in available_schedules():
        try:
            result = simulate(name, P, M, latency=args.latency)
        except ValueError as e:
            print(f'{name}: skipped ({e})')
            continue
        interlocks = result.chained is not None and result.period < result.makespan - 1e-9
        if interlocks:
            timeline, focus = result.chained, len(result.chained.iterations()) // 2
        else:
            timeline, focus = result.timeline, None
        title = (f'{name}   P={P} M={M}   idle {result.worst("idle_interlocked"):g} '
                 f'(synced {result.worst("idle_synced"):g})   peak act. mem '
                 f'{result.worst("peak_activation_memory"):g}   params/rank {result.worst("params"):g}')
        path = os.path.join(args.out, f'{name}.png')
        plot_timeline(timeline, path, title=title, reference_end=reference, focus_iteration=focus)
        print(f'{name}: {path}')


if __name__ == '__main__':
    main()
