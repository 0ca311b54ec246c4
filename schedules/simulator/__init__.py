"""The simulator: every rank's instruction stream run together without a model.

    simulate.py  simulate(schedule, stages, micro_batches, ...) -> SimResult (timelines, idle time,
                 peak activation memory); deadlocks and protocol errors raise ScheduleError
    effects.py   what an instruction does to a rank (effects), the handlers by instruction type
    streams.py   every rank's stream compiled into effects once
    structure.py the streams run together: checked, written down as timing nodes, kept per schedule
    timing.py    the nodes timed at a call's costs; passes, columns and memory peaks read back
    timeline.py  Timeline and Pass: the format simulated and traced runs share

In that order each step uses only the ones before it.

It reads the vocabulary (schedules/instructions.py, placement.py, registry.py) and the schedule
definitions; it never imports an engine.
"""
