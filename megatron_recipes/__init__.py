"""megatron-recipes: recipes, training, conversion and launch on top of megatron-core."""

from megatron_recipes.runtime import lazy_compile as _lazy_compile

_lazy_compile.install()  # before anything imports megatron-core (see the module for why)

__version__ = "0.1.0"
