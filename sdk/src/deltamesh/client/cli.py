"""`generate` on the command line (also `deltamesh generate`)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from deltamesh.client import Client, DeltameshError


def generate(
    prompt: Annotated[str, typer.Argument(help="Prompt text (or a chat message with --chat)")],
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate at most")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float | None, typer.Option(help="default: the server's")] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable)")] = None,
    stream: Annotated[bool, typer.Option("--stream/--no-stream", help="Print tokens as they arrive")] = False,
    chat: Annotated[bool, typer.Option("--chat", help="Send the prompt as a user chat message")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON")] = False,
    address: Annotated[
        str, typer.Option("--address", "--router", envvar="DELTAMESH_ADDRESS", help="The router's gRPC client API")
    ] = "127.0.0.1:50051",
    timeout: Annotated[float, typer.Option(help="Seconds")] = 300.0,
    api_key: Annotated[str | None, typer.Option(envvar="DELTAMESH_API_KEY", help="The router's API key")] = None,
) -> None:
    """Generate a completion through a deltamesh router."""
    payload = [{"role": "user", "content": prompt}] if chat else prompt
    kwargs: dict[str, Any] = dict(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop or ()
    )
    try:
        with Client(address, timeout=timeout, api_key=api_key) as client:
            if stream:
                last = None
                with client.stream(payload, **kwargs) as s:
                    for delta in s:
                        sys.stdout.write(delta.text)
                        sys.stdout.flush()
                        last = delta
                print()
                if last is not None:
                    u = last.usage
                    print(
                        f"[{last.finish_reason}; {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens]",
                        file=sys.stderr,
                    )
                return
            result = client.generate(payload, **kwargs)
    except DeltameshError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    if as_json:
        print(
            json.dumps(
                {
                    "request_id": result.request_id,
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "finish_reason": result.finish_reason,
                    "usage": vars(result.usage),
                }
            )
        )
    else:
        print(result.text)


def main() -> None:
    app = typer.Typer(add_completion=False)
    app.command()(generate)
    app()
