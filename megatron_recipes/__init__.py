"""megatron-recipes: recipes, training, conversion and launch on top of megatron-core."""

__version__ = "0.1.0"
