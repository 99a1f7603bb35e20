"""``python -m shardwise`` (also how torchrun starts it: ``torchrun ... -m shardwise train``).

The signal handlers go in before anything else is imported: the command line imports torch, which
takes seconds, and a SIGTERM or Ctrl-C then must still exit 143 or 130 in one line (``signals``).
"""

import sys

from shardwise import signals

signals.install()
try:
    from shardwise.cli import main

    code = main()
except KeyboardInterrupt as exc:  # during the imports above, before main() handles it
    print(f"shardwise: {signals.describe(exc)}", file=sys.stderr)
    code = signals.exit_code(exc)
signals.restore_defaults()  # a signal while the interpreter shuts down ends it quietly
sys.exit(code)
