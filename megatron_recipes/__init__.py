"""megatron-recipes: recipes, training, conversion and launch on top of megatron-core."""

# Importing the package changes nothing in torch or megatron-core: the entry points apply
# runtime/patches/ explicitly.

__version__ = "0.1.0"
