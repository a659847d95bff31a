"""What the wheel is built from, for the wheel's test and the Dockerfile's."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "iscore", "app", "data")
"""What the build reads (the project, its readme, the packages and what pyproject.toml maps in)."""
