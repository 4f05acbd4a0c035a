"""Pydantic validation errors as one line that names each field, for the YAML specs users edit."""

from __future__ import annotations

from pydantic import ValidationError


def validation_problems(error: ValidationError, top: str) -> str:
    """`field.path: message` for each error, joined by "; "; `top` names an error of the whole document."""
    return "; ".join(
        f"{'.'.join(str(part) for part in item['loc']) or top}: {item['msg']}" for item in error.errors()
    )
