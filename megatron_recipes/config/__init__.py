"""Recipes: typed schema, Hydra composition, errors and derived quantities. The bottom layer: it imports
no other package of the library (the rule table is ``validation``, the cost model ``estimate``)."""

from megatron_recipes.config.compose import compose_recipe, from_yaml, to_yaml
from megatron_recipes.config.errors import RecipeError, ValidationError, Violation
from megatron_recipes.config.schema import RunConfig

__all__ = ["compose_recipe", "from_yaml", "to_yaml", "RecipeError", "ValidationError", "Violation", "RunConfig"]
