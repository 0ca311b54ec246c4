"""Draw a traced run (train.py --trace FILE) beside the simulator's prediction from its own costs.

    python scripts/plot_trace.py runs/trace.json --out runs/trace.png [--iteration K] [--latency-us L]

Top: what the ranks did in one traced step (seconds). Bottom: the same schedule simulated with
what that trace measured (F, B, W, BW times as means per rank and chunk, the time a send and a
receive take on their own rank in 2-rank traces, the engine's time between instructions) and the
given p2p latency. Same renderer, same scale: the differences are what the cost model misses.
"""
import argparse
import os


def main(argv=None):
    from schedules.observe.plot import plot_measured_vs_predicted
    from schedules.observe.trace import (
        load_chrome_trace,
        load_p2p_events,
        measured_overheads,
        one_iteration,
        predict,
    )

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--out", required=True)
    p.add_argument("--iteration", type=int, default=None, help="traced step to draw (default: the last)")
    p.add_argument("--latency-us", type=float, default=0.0, help="p2p latency for the prediction")
    args = p.parse_args(argv)

    timeline, p2p = load_chrome_trace(args.trace)
    iteration = timeline.iterations()[-1] if args.iteration is None else args.iteration
    measured = one_iteration(timeline, iteration)
    p2p_cpu, dispatch = measured_overheads(timeline, load_p2p_events(args.trace))
    predicted = predict(measured, args.latency_us * 1e-6, p2p_cpu, dispatch)
    _, span = measured.span()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    plot_measured_vs_predicted(measured, predicted, args.out,
                               title=f"{measured.meta.get('schedule')}, step {iteration}: ")
    print(f"{args.out}: measured {span * 1e3:.2f} ms, predicted {predicted.makespan * 1e3:.2f} ms "
          f"(a send / a receive: {p2p_cpu[0] * 1e6:.0f} / {p2p_cpu[1] * 1e6:.0f} us on its rank)")


if __name__ == "__main__":
    main()
