"""The `turboio` console script: the command-line tool, the same code as the Rust binary
(`turboio --help`), run by the extension."""

import signal
import sys


def main():
    from . import _turboio

    # As the binary: Ctrl-C ends the command at once (Python's own handler would wait for it).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    return _turboio._cli_main(["turboio", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
