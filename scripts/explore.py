"""Serve the schedule explorer on this machine and print its address (docs/explore.md).

    python scripts/explore.py [--port 0] [--host 127.0.0.1] [--no-browser]

The page draws the simulator's timelines of the schedules you pick on one time axis, with their bubble, memory
and dependencies, the chooser's ranked table, a profile saved by scripts/choose_schedule.py --save or a trace
written by train.py --trace over its prediction. Everything is served from this process: nothing is fetched
from elsewhere. Ctrl-C stops it.
"""
import argparse
import contextlib
import signal
import sys
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser on the page")
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        print(f"error: --port {args.port}: pass 0 .. 65535 (0: any free port)", file=sys.stderr)
        return 2
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's accelerator notice on import: keep stdout clean
        from schedules.planner.explore import serve
    try:
        server, url = serve(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port} ({e.strerror}): pick another --port, or 0",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a kill stops it as Ctrl-C does
    print(url, flush=True)
    if not args.no_browser:
        import webbrowser
        webbrowser.open(url)
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.shutdown()
        server.server_close()  # its simulating processes too
    return 0


if __name__ == "__main__":
    sys.exit(main())
