"""Slurm launch: a recipe -> a self-contained sbatch script (pyxis/enroot, rendezvous, preemption requeue).

The recipe already knows the nodes, GPUs per node, container and layout, so the script is generated
from it rather than hand-written. ``megatron-recipes slurm render|submit <recipe> [overrides]``.

Module map: ``launch_plan`` (recipe -> validated ``LaunchPlan``), ``checks`` (Slurm's value syntax; the
settings are judged by the rule table's ``launch`` scope, validation/rules_launch.py), ``container`` (pyxis
flags, mounts, host <-> container paths), ``environment`` (NCCL/CUDA variables and why), ``commands`` (the srun/torchrun command lines, shared
with the in-container entry ``megatron_recipes._launch.entry``), ``dryrun`` (prints them per node, via
that entry's own code), ``script`` (the sbatch text), ``submit`` (sbatch), ``cli``, ``probe`` (an
all-reduce smoke test). Preemption on the trainer's side: ``megatron_recipes.training.preemption``.

Container images: pyxis runs enroot images. Build the project's image from the ``Dockerfile`` and turn
it into a squashfs file once, on a node with enroot::

    docker build -t megatron-recipes:latest .
    enroot import -o megatron-recipes.sqsh dockerd://megatron-recipes:latest

(or import straight from a registry: ``enroot import -o img.sqsh docker://<registry>#<repo>:<tag>``),
then point the recipe at it: ``cluster.container_image=/shared/images/megatron-recipes.sqsh``.
"""
