"""Observing real runs: tracing passes into Timelines, drawing Timelines, measuring memory.

    trace.py   traced(engine_cls), Tracer, the simulator's costs measured from a trace
    plot.py    draws a Timeline (simulated or traced), and a measured step above its prediction
    memory.py  the saved-tensor tracker, RSS and its peak, the machine a measurement ran on
"""
