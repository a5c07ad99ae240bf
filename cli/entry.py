"""The `kvf` program's entry point: signal handlers first, then the CLI.

Ctrl-C and SIGTERM become exceptions kvf catches at the top (kvf.cli.main), so they end in one
line, "interrupted; re-run the same command to resume", and exit 130 / 143, whatever is running
(model, store writes, the JVM: it is started with -Xrs and leaves the signals to us). They are
BaseExceptions on purpose: no library's `except Exception` can swallow them.
"""
import signal


class Interrupted(BaseException):
    code, word = 130, "interrupted"


class Terminated(BaseException):
    code, word = 143, "terminated"


def _raise(exc_type):
    def handler(signum, frame):
        raise exc_type()
    return handler


def main():
    signal.signal(signal.SIGINT, _raise(Interrupted))
    signal.signal(signal.SIGTERM, _raise(Terminated))
    try:
        from kvf.cli.main import main as cli_main  # torch and friends take seconds to import
    except (Interrupted, Terminated) as e:
        import sys
        print(f"kvf: {e.word}; re-run the same command to resume", file=sys.stderr)
        sys.exit(e.code)
    cli_main()
