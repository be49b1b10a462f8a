"""Defaults that commands need without loading the engine (no torch import here)."""

from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "deltamesh-tiny"
