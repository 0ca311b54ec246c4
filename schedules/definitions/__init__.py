"""Schedule definitions, one file per family. Each schedule is a named `OrderedSchedule` subclass
(schedules/lowering.py) whose `compute_order()` reads like its paper's figure, phase by phase.

    zero_bubble.py  ZB-H1, ZB-H2 (LaggedSchedule: two lags per stage)
    interleaved.py  Interleaved 1F1B
    vshape.py       ZB-V, DualPipeV (the V placement)
    controllable_memory.py  V-Half, V-Min (the V placement, built from the paper's building block)
    dualpipe.py     DualPipe (the mirror placement); dualpipe_steps, shared with DualPipeV

They import only the vocabulary (passes, placement, lowering): no engine, no simulator.
"""
