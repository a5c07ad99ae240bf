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
from typing import NoReturn


class Stopped(BaseException):
    """A signal turned into an exception; ends kvf in its one line."""
    code: int
    word: str
    signum: signal.Signals

    def exit(self, resumable: bool = True) -> NoReturn:
        """resumable: the command picks up where it stopped (build-cache, run); others start again."""
        again = "resume" if resumable else "start again"
        print(f"kvf: {self.word}; re-run the same command to {again}", file=sys.stderr)
        sys.exit(self.code)


class Interrupted(Stopped):
    code, word, signum = 130, "interrupted", signal.SIGINT


class Terminated(Stopped):
    code, word, signum = 143, "terminated", signal.SIGTERM


def _raise(exc_type):
    def handler(signum, frame):
        raise exc_type()
    return handler


def _redeliver_swallowed_signals(unraisable):
    if isinstance(unraisable.exc_value, Stopped):  # later, not now: we are still inside the callback
        threading.Timer(0.05, os.kill, (os.getpid(), unraisable.exc_value.signum)).start()
        return
    sys.__unraisablehook__(unraisable)


def main():
    sys.unraisablehook = _redeliver_swallowed_signals  # before the handlers: no signal can miss it
    signal.signal(signal.SIGINT, _raise(Interrupted))
    signal.signal(signal.SIGTERM, _raise(Terminated))
    try:
        from kvf.cli.main import main as cli_main  # torch and friends take seconds to import
    except Stopped as e:
        e.exit()
    cli_main()
