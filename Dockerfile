# syntax=docker/dockerfile:1
# megatron-recipes on NVIDIA's NGC PyTorch image (nvidia/pytorch in the NGC catalog), which already
# carries CUDA, NCCL, cuDNN, Transformer Engine and Apex for H100/H200 (x86_64) and GB200 (arm64).
# The tag is pinned: change PYTORCH_TAG on purpose, never implicitly. NGC_REGISTRY is the registry you
# pull NGC containers from (NGC's own, or your site's mirror of it); it has no default on purpose.
#   docker build --build-arg NGC_REGISTRY=<ngc-registry-host> -t megatron-recipes:latest .
#   enroot import -o megatron-recipes.sqsh dockerd://megatron-recipes:latest
#   megatron-recipes slurm submit <recipe> cluster.container_image=/shared/images/megatron-recipes.sqsh ...
# (slurm/README.md has the details.)
ARG NGC_REGISTRY
# 26.06: the image megatron-core 0.19's own CI builds on (Python 3.12, which megatron-core 0.17 on require).
ARG PYTORCH_TAG=26.06-py3
FROM ${NGC_REGISTRY}/nvidia/pytorch:${PYTORCH_TAG}

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/megatron-recipes
# Only what the package needs, so edits to tests or docs do not invalidate the install layer.
COPY pyproject.toml setup.py README.md ./
COPY megatron_recipes/ megatron_recipes/
COPY recipes/ recipes/
COPY launch/ launch/
# The `gpu` extra pins megatron-core to the tested release and TE to the range it supports. The base
# image's pip constraints keep its own torch/TE/NCCL builds: pip fails loudly rather than replacing them.
# The import check fails the build if the entry points cannot load; the build log shows the versions.
# (DL3013 reads ".[gpu]" as an unpinned package; it is this project, whose extra pins the versions.)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[gpu]" \
 && python -c "import megatron.core, transformer_engine.pytorch, megatron_recipes.train, megatron_recipes._launch.entry" \
 && python -m megatron_recipes.runtime.versions \
 && megatron-recipes --help > /dev/null

WORKDIR /workspace
