"""The `kvf` program's entry point: signal handlers first, then the CLI.

Ctrl-C and SIGTERM become exceptions kvf catches at the top (kvf.cli.main), so they end in one
line, "interrupted; re-run the same command to resume", and exit 130 / 143, whatever is running
(model, store writes, the JVM: it is started with -Xrs and leaves the signals to us). They are
BaseExceptions on purpose: no library's `except Exception` can swallow them.

Two places can still swallow them:
- a signal that lands while Python runs a callback whose exceptions are "unraisable" (a weakref callback
  inside an import, a __del__) is printed as "Exception ignored" and lost, and the build would go on. Our
  unraisable hook sees that one, prints nothing, and sends the same signal again a moment later, when
  ordinary code runs;
- code that catches every exception (a bare `except:`, or C code that clears any error it meets, as
  PyObject_HasAttr does) drops it without a word: a SIGTERM sent as build-cache's dense stage began (its
  imports and model load) once left the build running for minutes; where it was dropped is not known. A
  watcher thread, started with kvf, sends the first signal again while kvf has neither reached its one line nor is
  unwinding with the exception (cleanup in `finally` blocks runs undisturbed).
"""
import os
import signal
import sys
import threading
from typing import NoReturn

from kvf.errors import KvfError, raised_from


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


def signal_beneath(error: BaseException) -> Stopped | None:
    """The signal an error was raised over, if any. Code between the signal and kvf may wrap what it catches:
    Python 3.11 wraps an exception raised while a class body is made (__set_name__) in a RuntimeError, so a
    Ctrl-C during a library's import read "internal error: RuntimeError: Error calling __set_name__"."""
    for raised in raised_from(error):
        if isinstance(raised, Stopped):
            return raised
        if isinstance(raised, KeyboardInterrupt):
            return Interrupted()
    return None


RESEND_S = 1.0   # how often the watcher looks; it sends the signal again after two looks find it dropped
_exiting = threading.Event()   # set as kvf ends: from then on no signal is sent again
_first_signal: list[int] = []  # what the handlers caught first; a list append takes no lock a handler could wait on


def _raise(exc_type):
    def handler(signum, frame):
        if not _first_signal:
            _first_signal.append(signum)
        raise exc_type()
    return handler


def _unwinding(thread_id: int) -> bool:
    """Whether that thread is handling a Stopped (in an except, finally or __exit__ on its way out)."""
    current = sys._current_exceptions().get(thread_id)
    exc = current[1] if isinstance(current, tuple) else current   # 3.11: exc_info tuples; 3.12 on: the exception
    return isinstance(exc, Stopped)


def _watch() -> None:
    """Once a signal came: send it again while kvf neither ends nor unwinds with it, i.e. some code dropped it. Two
    looks in a row, RESEND_S apart, so a cleanup that handles an exception of its own is not hit. Started before
    any signal: starting a thread inside a handler could wait forever on a lock the interrupted code holds."""
    main_thread, dropped = threading.main_thread().ident, 0
    while not _exiting.wait(RESEND_S):
        if not _first_signal:
            continue
        dropped = 0 if _unwinding(main_thread) else dropped + 1
        if dropped >= 2:
            os.kill(os.getpid(), _first_signal[0])
            dropped = 0


def _redeliver_swallowed_signals(unraisable):
    if isinstance(unraisable.exc_value, Stopped):  # later, not now: we are still inside the callback
        threading.Timer(0.05, os.kill, (os.getpid(), unraisable.exc_value.signum)).start()
        return
    sys.__unraisablehook__(unraisable)


def main():
    sys.unraisablehook = _redeliver_swallowed_signals  # before the handlers: no signal can miss it
    signal.signal(signal.SIGINT, _raise(Interrupted))
    signal.signal(signal.SIGTERM, _raise(Terminated))
    threading.Thread(target=_watch, name="kvf-signal-watch", daemon=True).start()
    try:
        try:
            from kvf.cli.main import main as cli_main  # torch and friends take seconds to import
        except Stopped as e:
            e.exit()
        except KvfError as e:   # the CLI's flags come from the method files: one the user wrote may not load
            print(f"kvf: error: {e}", file=sys.stderr)
            sys.exit(1)
        except Exception as e:   # a signal an import wrapped (see signal_beneath)
            if (stopped := signal_beneath(e)) is None:
                raise
            stopped.exit()
        cli_main()
    finally:
        _exiting.set()   # kvf has said its line (or is done): interpreter shutdown is left alone
