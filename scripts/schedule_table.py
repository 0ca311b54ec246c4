"""Compare every registered pipeline schedule at one P (ranks) and M (micro-batches).

    python scripts/schedule_table.py --stages 4 --micro-batches 8 [--json]

Idle time is in forward units (a forward of one micro-batch through one 1F1B stage costs 1,
its backward 2), for the worst rank: `idle` when iterations follow back to back without an
optimizer barrier (interlocked), `idle synced` when each iteration starts after every rank
finished the last. Peak activation memory is in micro-batch activations of one 1F1B stage.
"""

import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

# DeepSpeed logs to stdout (its accelerator notice on import); keep stdout for the table / JSON.
with contextlib.redirect_stdout(sys.stderr):
    from schedules.registry import available_schedules
    from schedules.simulator.simulate import simulate


def rows(stages, micro_batches, latency=0.0):
    out = []
    for name, spec in available_schedules().items():
        row = {'schedule': name, 'idle_time': None, 'idle_time_synced': None, 'peak_activation_memory': None,
               'params_per_rank': None, 'per_rank': None, 'units': 'F', 'error': None}
        try:
            if stages < 2 and name != '1f1b':  # as train.py: one stage is DeepSpeed's 1F1B or no pipeline
                raise ValueError(f'{name} needs --stages >= 2')
            result = simulate(name, stages, micro_batches, latency=latency)
        except ValueError as e:  # the schedule's constraints exclude this P and M
            row['error'] = str(e)
        else:
            row.update(idle_time=result.worst('idle_interlocked'), idle_time_synced=result.worst('idle_synced'),
                       peak_activation_memory=result.worst('peak_activation_memory'),
                       params_per_rank=result.worst('params'), per_rank=result.per_rank, units=result.units)
        out.append(row)
    return out


def format_table(table):
    head = ['schedule', 'idle', 'idle synced', 'peak act. mem (rank)', 'params/rank', 'note']
    lines = []
    for row in table:
        if row['error']:
            lines.append([row['schedule'], '-', '-', '-', '-', row['error']])
            continue
        peak = row['peak_activation_memory']
        peak_rank = next(r['rank'] for r in row['per_rank'] if r['peak_activation_memory'] == peak)
        lines.append([row['schedule'], f"{row['idle_time']:g}", f"{row['idle_time_synced']:g}",
                      f'{peak:g} ({peak_rank})', f"{row['params_per_rank']:g}", ''])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: '  '.join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return '\n'.join([fmt(head), fmt(['-' * w for w in widths])] + [fmt(line) for line in lines])


def main():
    parser = common.add_point(common.parser(__doc__))
    parser.add_argument('--json', action='store_true', help='print a JSON list instead of a table')
    args = parser.parse_args()
    for flag, value, least in (('--stages', args.stages, 1), ('--micro-batches', args.micro_batches, 1),
                               ('--latency', args.latency, 0)):
        if value < least:  # one line, as train.py says it
            print(f'error: {flag} {value} is below {least}: pass {flag} N with N >= {least}', file=sys.stderr)
            sys.exit(2)
    table = rows(args.stages, args.micro_batches, args.latency)
    if args.json:
        print(json.dumps(table, indent=1))
    else:
        print(f'P={args.stages} M={args.micro_batches}; idle in forward units (worst rank), '
              f'memory in 1F1B-stage micro-batch activations, params in 1F1B stages')
        print(format_table(table))


if __name__ == '__main__':
    main()
