"""The text-only SSE events of a completions stream, written without the schema's models per token, are the very
bytes the schema writes (#45: the router's CPU per streamed token)."""

import json

from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.gateway.completions import _TextChunks
from deltamesh.services.router.gateway.streaming import sse


class _Body:
    model = 'a "quoted" model \\ name'


class _Reply:
    id, created, body = "cmpl-1", 1700000000, _Body()


def test_text_only_events_are_the_schemas_own_bytes():
    chunks = _TextChunks(_Reply())
    for index in (0, 3):
        for text in [
            "",
            " plain",
            'quotes " and \\ backslash',
            "é 日本 \U0001f600",
            "\n\t\x00\x1f",
            "\u2028",
            "a\x85b\u2029c\u2028",
            '"text":""',
        ]:
            expected = sse(
                oa.Completion(
                    id="cmpl-1",
                    created=1700000000,
                    model=_Body.model,
                    choices=[oa.CompletionChoice(index=index, text=text)],
                )
            )
            assert chunks.event(index, text) == expected
            # one line for any line reader (httpx's aiter_lines and requests' iter_lines split as str.splitlines)
            event, blank = expected.splitlines()
            assert blank == "" and json.loads(event.removeprefix("data: "))["choices"][0]["text"] == text
