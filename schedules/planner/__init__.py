"""The planner: which schedule to run, from measurements of the user's own model on the user's device.

    profile.py   per-layer F, B, W, BW seconds and saved bytes, parameters, optimizer step, output bytes;
                 p2p latency and per-byte cost between ranks; the framework's own work per pass (JSON)
    compose.py   a cut of the layers and a placement -> the simulator's costs and memory per (rank, chunk)
    candidate.py one schedule on one cut of the layers, simulated: what the chooser ranks
    choose.py    every trainable schedule x v x cut simulated, filtered by a memory budget, ranked (with
                 split=True also the vocabulary head split over the ranks: compose.split_head)
    layout.py    the split head's rows and recomputed shares fitted to one schedule (train.py --vocab-layout auto)
    explore.py   the local page (scripts/explore.py): a server over the simulator, the chooser and traces,
                 and its static files in explore_static/

It reads the registry and the simulator, the deferrable Linear's B / W split and the split head's slice layout
(runtime/vocab_parallel.py); it never builds an engine.
"""
