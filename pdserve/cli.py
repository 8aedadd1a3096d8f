"""The ``pdserve`` command: ``serve | proxy | up | chat | bench``.

Each subcommand owns its own argument parser in its module; this file only dispatches, so that
``pdserve proxy --help`` does not import torch.
"""

from __future__ import annotations

import importlib
import os
import sys

# torch's OpenMP threads spin-wait between parallel regions by default; on a small shared CPU box
# (P, D and the proxy on two cores) that spinning starves the other processes. Passive waiting must
# be chosen before torch is imported, and spawned engine processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_COMMANDS = {
    "serve": ("pdserve.entrypoints.server", "OpenAI-compatible engine server (P, D or single instance)"),
    "proxy": ("pdserve.router.proxy", "P->D disaggregation proxy (stateless or --multi-turn)"),
    "up": ("pdserve.launcher", "start a prefiller, a decoder and the proxy on this host"),
    "chat": ("pdserve.commands.chat", "interactive terminal chat against an endpoint"),
    "bench": ("pdserve.bench.cli", "benchmarks: 'pdserve bench multi-turn'"),
}


def _usage() -> str:
    lines = ["usage: pdserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<7} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += ["", "Run 'pdserve <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from pdserve import __version__

        print(f"pdserve {__version__}")
        return 0
    cmd = argv[0]
    if cmd not in _COMMANDS:
        print(f"pdserve: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(_COMMANDS[cmd][0])
    rc = module.main(argv[1:])
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
