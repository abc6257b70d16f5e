"""Only here to list the data packages that pyproject.toml maps from top-level folders (see package-dir)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["megatron_recipes", "megatron_recipes.*"])
    + ["megatron_recipes._recipes", "megatron_recipes._launch"],
)
