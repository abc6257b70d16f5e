"""The recipe tree (YAML only); shipped inside the wheel as ``megatron_recipes._recipes``."""
