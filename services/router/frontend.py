"""What the router knows of the model without loading it: tokenizer, chat template, vocabulary and context
length. Requests are tokenized and checked here, before any worker sees them."""

from __future__ import annotations

from pathlib import Path

from engine import EngineConfig, RequestError, SamplingParams, validate_request
from engine.config import ModelConfig
from engine.tokenizer import TemplateError, Tokenizer


class Frontend:
    def __init__(self, model_dir: str, max_model_len: int | None = None):
        path = Path(model_dir)
        self.model_config = ModelConfig.from_dir(path)
        self.tokenizer = Tokenizer(path) if (path / "tokenizer.json").is_file() else None
        self.model_id = path.name
        self.max_model_len = EngineConfig(max_model_len=max_model_len).resolved_max_model_len(
            self.model_config.max_position_embeddings
        )

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer; send token ids")
        return self.tokenizer

    def encode_text(self, text: str) -> list[int]:
        return self._need_tokenizer().encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        try:
            return self._need_tokenizer().encode_chat(messages)
        except TemplateError as e:
            raise RequestError(str(e)) from None

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, self.vocab_size, self.max_model_len)
