"""The simulator: every rank's instruction stream run together without a model.

    simulate.py  simulate(schedule, stages, micro_batches, ...) -> SimResult (timelines, idle time,
                 peak activation memory); deadlocks and protocol errors raise ScheduleError
    timeline.py  Timeline and Pass: the format simulated and traced runs share

It reads the vocabulary (schedules/instructions.py, placement.py, registry.py) and the schedule
definitions; it never imports an engine.
"""
