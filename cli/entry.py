"""The `kvf` program's entry point: signal handlers first, then the CLI.

Ctrl-C and SIGTERM become exceptions kvf catches at the top (kvf.cli.main), so they end in one
line, "interrupted; re-run the same command to resume", and exit 130 / 143, whatever is running
(model, store writes, the JVM: it is started with -Xrs and leaves the signals to us). They are
BaseExceptions on purpose: no library's `except Exception` can swallow them.

One place can still swallow them: a signal that lands while Python runs a callback whose exceptions
are "unraisable" (a weakref callback inside an import, a __del__) is printed as "Exception ignored"
and lost, and the build would go on. Our unraisable hook sees that one, prints nothing, and sends
the same signal again a moment later, when ordinary code runs.
"""
import os
import signal
import sys
import threading


class Interrupted(BaseException):
    code, word, signum = 130, "interrupted", signal.SIGINT


class Terminated(BaseException):
    code, word, signum = 143, "terminated", signal.SIGTERM


def _raise(exc_type):
    def handler(signum, frame):
        raise exc_type()
    return handler


def _redeliver_swallowed_signals(unraisable):
    if isinstance(unraisable.exc_value, (Interrupted, Terminated)):
        signum = unraisable.exc_value.signum
        threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()  # not now: we are still inside the callback
        return
    sys.__unraisablehook__(unraisable)


def main():
    signal.signal(signal.SIGINT, _raise(Interrupted))
    signal.signal(signal.SIGTERM, _raise(Terminated))
    sys.unraisablehook = _redeliver_swallowed_signals
    try:
        from kvf.cli.main import main as cli_main  # torch and friends take seconds to import
    except (Interrupted, Terminated) as e:
        print(f"kvf: {e.word}; re-run the same command to resume", file=sys.stderr)
        sys.exit(e.code)
    cli_main()
