"""The ``pyrobdl`` command line."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pyrobdl`` console script; returns the exit status."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="pyrobdl", description="Compare Bayesian-neural-network inference methods.")
    parser.add_argument("--version", action="version", version=f"pyrobdl {__version__}")
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
