"""A process the channel test drives: ``python -m tests.bench.echo_driven --control ADDRESS``
answers ``echo`` with what it was sent."""

from __future__ import annotations

import sys

from dsa_bridge.transfer.bench.channel import serve_commands

if __name__ == "__main__":
    assert sys.argv[1] == "--control"
    sys.exit(serve_commands(sys.argv[2], {"echo": lambda **fields: fields}, idle_exit_s=60))
