"""Chat templates (Jinja) shipped with the project; see ``megatron_recipes.data.sft.templates``."""
