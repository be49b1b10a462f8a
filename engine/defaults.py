"""Defaults that commands need without loading the engine (no torch import here)."""

from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "deltamesh-tiny"
