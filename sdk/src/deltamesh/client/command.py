"""The `deltamesh-client` script: the command line when the package's `cli` extra (typer) is installed, else one
line saying how to install it (the library itself needs only grpcio and protobuf)."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from deltamesh.client.cli import main as cli_main
    except ModuleNotFoundError as e:
        if e.name not in ("typer", "click", "rich"):
            raise
        sys.exit(
            "deltamesh-client: the command line needs the package's cli extra: pip install 'deltamesh-client[cli]'"
        )
    cli_main()
