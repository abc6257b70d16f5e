"""Recipes: typed schema, Hydra composition, derived quantities and the validation rule table."""

from megatron_recipes.config.compose import compose_recipe, from_yaml, to_yaml
from megatron_recipes.config.errors import RecipeError, ValidationError, Violation
from megatron_recipes.config.schema import RunConfig

__all__ = ["compose_recipe", "from_yaml", "to_yaml", "RecipeError", "ValidationError", "Violation", "RunConfig"]
