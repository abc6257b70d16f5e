"""Chat templates: the tokenizer's own, one shipped with the project by name, or a local .jinja file."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import List, Optional

from megatron_recipes.config.errors import RecipeError

_PACKAGE = "megatron_recipes.data.templates"


def shipped_templates() -> List[str]:
    return sorted(p.name[: -len(".jinja")] for p in resources.files(_PACKAGE).iterdir() if p.name.endswith(".jinja"))


def template_text(name: str) -> str:
    """Jinja source of a shipped template (``chatml``, ``llama3``) or of a ``.jinja`` file path."""
    if name.endswith(".jinja") or "/" in name:
        path = Path(name).expanduser()
        if not path.is_file():
            raise RecipeError(f"chat template file '{name}' does not exist", fix="give a .jinja file path or a shipped name")
        return path.read_text(encoding="utf-8")
    shipped = resources.files(_PACKAGE) / f"{name}.jinja"
    if not shipped.is_file():
        raise RecipeError(
            f"unknown chat template '{name}'",
            fix=f"use one shipped with the project ({', '.join(shipped_templates())}), a .jinja path, "
            "or leave data.chat_template unset to use the tokenizer's own",
        )
    return shipped.read_text(encoding="utf-8")


def resolve_template(requested: Optional[str], hf_tokenizer, source: str) -> str:
    """The template to render with: ``requested`` when set, else the tokenizer's ``chat_template``."""
    if requested:
        return template_text(requested)
    own = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: HF picks "default"
        own = own.get("default")
    if not own:
        raise RecipeError(
            f"tokenizer '{source}' has no chat template",
            fix=f"set data.chat_template to one of {', '.join(shipped_templates())} or a .jinja file",
        )
    return own
