"""Launch rules (scope ``launch``): Slurm settings that would fail only after the job waited in the queue.

`slurm render|submit` judges them with the recipe and input rules in one pass. Their checks get the
``Host``: paths on this host (the image file, mount sources) are judged only when ``host.check_paths``
(off with ``--skip-path-checks`` when rendering away from the cluster).
"""

from __future__ import annotations

from typing import List, Optional

from megatron_recipes.config import container_flags as container
from megatron_recipes.config.schema import GPU_REQUESTS, LAUNCHERS, RunConfig
from megatron_recipes.config.slurm_syntax import (
    ENV_NAME, MEM, MEM_PER_UNIT, OWNED_OPTIONS, option_name, signal_name, time_limit_seconds,
)
from megatron_recipes.validation.rules_base import Host, choices, rule


def _limit(cfg: RunConfig) -> Optional[int]:
    """The time limit in seconds (None: unlimited); raises ValueError when unreadable."""
    return time_limit_seconds(cfg.cluster.time_limit)


def _joined(problems: List[str]) -> Optional[str]:
    return "; ".join(problems) or None


@rule("slurm.account", ["cluster.account", "cluster.partition"],
      "a cluster with require_account=true names an account and a partition",
      lambda cfg: " ".join(f"cluster.{f}=<your {f}>" for f in ("account", "partition") if not getattr(cfg.cluster, f))
      or "cluster.account=<your account> cluster.partition=<your partition>", scope="launch")
def _account(cfg: RunConfig, _host: Host) -> Optional[str]:
    c = cfg.cluster
    missing = [f for f in ("account", "partition") if c.require_account and not getattr(c, f)]
    if not missing:
        return None
    return (f"cluster {c.name} requires an account and a partition (cluster.require_account=true) "
            f"but {' and '.join('cluster.' + f for f in missing)} is unset")


@rule("slurm.time_limit", ["cluster.time_limit"], "cluster.time_limit is a Slurm time (or UNLIMITED)",
      "use HH:MM:SS, D-HH:MM:SS or minutes, e.g. cluster.time_limit=04:00:00", scope="launch")
def _time_limit(cfg: RunConfig, _host: Host) -> Optional[str]:
    try:
        _limit(cfg)
    except ValueError:
        return f"cluster.time_limit='{cfg.cluster.time_limit}' is not a Slurm time"
    return None


@rule("slurm.preempt_signal", ["cluster.preempt_signal"], "cluster.preempt_signal is a signal the job can trap",
      "use USR1 (default), USR2 or TERM", scope="launch")
def _preempt_signal(cfg: RunConfig, _host: Host) -> Optional[str]:
    if signal_name(cfg.cluster.preempt_signal) is None:
        return f"cluster.preempt_signal='{cfg.cluster.preempt_signal}' is not a signal the job can trap"
    return None


@rule("slurm.preempt_lead", ["cluster.preempt_signal_lead_s", "cluster.time_limit"],
      "the preemption signal comes 1..65535 seconds before the time limit",
      "leave time for one checkpoint save, e.g. cluster.preempt_signal_lead_s=300", scope="launch")
def _preempt_lead(cfg: RunConfig, _host: Host) -> Optional[str]:
    try:
        limit = _limit(cfg)
    except ValueError:
        return None  # slurm.time_limit names it
    lead = cfg.cluster.preempt_signal_lead_s
    if 1 <= lead <= 65535 and (limit is None or lead < limit):
        return None
    bound = f"below the time limit ({limit} s) and " if limit is not None else ""
    return f"cluster.preempt_signal_lead_s={lead} must be {bound}between 1 and 65535 seconds"


@rule("slurm.max_restarts", ["cluster.max_restarts"], "cluster.max_restarts is 0 or more",
      "use 0 (never requeue) or more", scope="launch")
def _max_restarts(cfg: RunConfig, _host: Host) -> Optional[str]:
    n = cfg.cluster.max_restarts
    return f"cluster.max_restarts={n} is negative" if n < 0 else None


@rule("slurm.launcher", ["cluster.launcher"], f"cluster.launcher is one of {choices(LAUNCHERS)}",
      "torchrun (one task per node, c10d rendezvous) or pmix (one task per GPU, srun --mpi=pmix)", scope="launch")
def _launcher(cfg: RunConfig, _host: Host) -> Optional[str]:
    c = cfg.cluster
    return None if c.launcher in LAUNCHERS else f"cluster.launcher='{c.launcher}' is not one of {LAUNCHERS}"


@rule("slurm.gpu_request", ["cluster.gpu_request"], f"cluster.gpu_request is one of {choices(GPU_REQUESTS)}",
      "gpus-per-node where Slurm schedules with cons_tres, gres where GPUs are requested as --gres=gpu:N",
      scope="launch")
def _gpu_request(cfg: RunConfig, _host: Host) -> Optional[str]:
    value = cfg.cluster.gpu_request
    return None if value in GPU_REQUESTS else f"cluster.gpu_request='{value}' is not one of {GPU_REQUESTS}"


@rule("slurm.cpus", ["cluster.cpus_per_task", "cluster.gpus_per_node"],
      "cluster.cpus_per_task (when set) is at least one CPU per rank of the node",
      lambda cfg: f"cluster.cpus_per_task >= {cfg.cluster.gpus_per_node}, or null for Slurm's default", scope="launch")
def _cpus(cfg: RunConfig, _host: Host) -> Optional[str]:
    c = cfg.cluster
    if c.cpus_per_task is not None and c.cpus_per_task < c.gpus_per_node:
        return f"cluster.cpus_per_task={c.cpus_per_task} CPUs per node cannot feed {c.gpus_per_node} ranks"
    return None


@rule("slurm.mem", ["cluster.mem", "cluster.sbatch_extra"],
      "cluster.mem (sbatch --mem per node) is a size like 0 (the whole node), 512G or 800000, and is not "
      "combined with --mem-per-cpu/--mem-per-gpu extras (sbatch refuses both)",
      "cluster.mem=0 (all of each node's memory), cluster.mem=<N>[K|M|G|T], or cluster.mem=null to use "
      "--mem-per-cpu/--mem-per-gpu in cluster.sbatch_extra", scope="launch")
def _mem(cfg: RunConfig, _host: Host) -> Optional[str]:
    mem = cfg.cluster.mem
    if mem is None:
        return None
    if not MEM.match(str(mem)):
        return f"cluster.mem={mem!r} is not an sbatch --mem size"
    per_unit = [str(x) for x in cfg.cluster.sbatch_extra if option_name(str(x)) in MEM_PER_UNIT]
    if per_unit:
        return f"cluster.mem={mem} sets --mem, and cluster.sbatch_extra sets {per_unit}: sbatch accepts only one"
    return None


def _extra_items(cfg: RunConfig):
    for field, items in (("cluster.sbatch_extra", cfg.cluster.sbatch_extra), ("cluster.srun_extra", cfg.cluster.srun_extra)):
        for item in items:
            yield field, item, option_name(str(item))


def _well_formed(item: object, name: str) -> bool:
    return name.startswith("-") and "\n" not in str(item)


@rule("slurm.extra_format", ["cluster.sbatch_extra", "cluster.srun_extra"], "each extra Slurm option is one option",
      "one option per list item, e.g. ['--qos=high', '--constraint=ib']", scope="launch")
def _extra_format(cfg: RunConfig, _host: Host) -> Optional[str]:
    return _joined([f"{field} item {item!r} is not one option" for field, item, name in _extra_items(cfg)
                    if not _well_formed(item, name)])


@rule("slurm.extra_owned", ["cluster.sbatch_extra", "cluster.srun_extra"],
      "extra Slurm options do not set what the recipe controls (nodes, time, container, output, ...)",
      "remove the option from the extras and set the recipe field named above instead", scope="launch")
def _extra_owned(cfg: RunConfig, _host: Host) -> Optional[str]:
    return _joined([f"{field} sets {name}, which the recipe controls through {OWNED_OPTIONS[name]}"
                    for field, item, name in _extra_items(cfg) if _well_formed(item, name) and name in OWNED_OPTIONS])


@rule("slurm.env_name", ["cluster.env"], "cluster.env keys are environment variable names",
      "letters, digits and _ only, not starting with a digit", scope="launch")
def _env_name(cfg: RunConfig, _host: Host) -> Optional[str]:
    return _joined([f"cluster.env key '{key}' is not a variable name" for key in cfg.cluster.env
                    if not ENV_NAME.match(str(key))])


@rule("slurm.container_image", ["cluster.container_image", "cluster.container_mounts", "cluster.container_workdir"],
      "container mounts or a workdir come with a container image; a local image file exists",
      "cluster.container_image=/path/to/image.sqsh (see slurm/README.md: enroot import, "
      "`enroot import -o IMAGE.sqsh dockerd://IMAGE:TAG`), or clear the container settings to run without one",
      scope="launch")
def _container_image(cfg: RunConfig, host: Host) -> Optional[str]:
    c = cfg.cluster
    if not container.image_of(c):
        set_ = [f for f in ("container_mounts", "container_workdir") if getattr(c, f)]
        if set_:
            return f"{', '.join('cluster.' + f for f in set_)} asks for pyxis but cluster.container_image is unset"
        return None
    image = c.container_image
    if container.image_is_local_file(image) and host.check_paths and container.missing_on_this_host(image):
        return f"image file '{image}' does not exist"
    return None


@rule("slurm.container_chosen", ["cluster.container_image"],
      "a GPU cluster's job names its container image, or says cluster.container_image=none",
      "cluster.container_image=/path/to/image.sqsh (slurm/README.md builds one), or cluster.container_image=none "
      "when every node has this very Python installation at the same path", scope="launch")
def _container_chosen(cfg: RunConfig, _host: Host) -> Optional[str]:
    c = cfg.cluster
    if c.gpu_arch == "cpu" or c.container_image:
        return None
    import sys

    return (f"cluster {c.name} has no cluster.container_image: the job would run {sys.executable} (this machine's "
            "Python) on every node")


def _mount_problems(cfg: RunConfig) -> List[str]:
    out = []
    for entry in cfg.cluster.container_mounts if container.image_of(cfg.cluster) else ():
        try:
            container.parse_mount(entry)
        except container.MountError as exc:
            out.append(str(exc))
    return out


@rule("slurm.mount_syntax", ["cluster.container_mounts"], "each container mount is SRC[:DST[:FLAGS]] that pyxis can parse",
      "write each mount as '/abs/source:/abs/target[:ro]', one list item per mount", scope="launch")
def _mount_syntax(cfg: RunConfig, _host: Host) -> Optional[str]:
    return _joined(_mount_problems(cfg))


@rule("slurm.mount_source", ["cluster.container_mounts"], "container mount sources exist (judged on a host that has their filesystem)",
      "fix the path (or pass --skip-path-checks when rendering away from the cluster)", scope="launch")
def _mount_source(cfg: RunConfig, host: Host) -> Optional[str]:
    if not host.check_paths or not container.image_of(cfg.cluster):
        return None
    sources = []
    for entry in cfg.cluster.container_mounts:
        try:
            sources.append(container.parse_mount(entry).source)
        except container.MountError:
            continue  # slurm.mount_syntax names it
    return _joined([f"mount source '{s}' does not exist on this host" for s in sources if container.missing_on_this_host(s)])


@rule("slurm.workdir", ["cluster.container_workdir"], "cluster.container_workdir is an absolute path",
      "use an absolute path", scope="launch")
def _workdir(cfg: RunConfig, _host: Host) -> Optional[str]:
    w = cfg.cluster.container_workdir
    if container.image_of(cfg.cluster) and w and not w.startswith("/"):
        return f"cluster.container_workdir='{w}' is not an absolute path"
    return None


def _run_dir_fix(cfg: RunConfig) -> str:
    """run.dir is the path the ranks see in the container: name it under a mount's target (or add a mount)."""
    try:
        targets = [m.target for m in container.parse_mounts(cfg.cluster.container_mounts)]
    except container.MountError:
        targets = []
    under = (f"set run.dir to a path under a mount target as the container sees it (e.g. run.dir="
             f"{targets[0].rstrip('/')}/<run name>)" if targets else "")
    add = f"add a mount whose target holds it, e.g. cluster.container_mounts=['/host/folder:{cfg.run.dir}']"
    return f"{under}, or {add}" if under else add


@rule("slurm.run_dir_mounted", ["run.dir", "cluster.container_mounts"], "in a container, run.dir lies under a container mount",
      _run_dir_fix, scope="launch")
def _run_dir_mounted(cfg: RunConfig, _host: Host) -> Optional[str]:
    if not container.image_of(cfg.cluster) or _mount_problems(cfg):
        return None
    if container.inside_any_mount(cfg.run.dir, container.parse_mounts(cfg.cluster.container_mounts)):
        return None
    return (f"run.dir '{cfg.run.dir}' is not under any container mount: checkpoints and logs would "
            "vanish with the container")


@rule("slurm.run_dir", ["run.dir"], "run.dir holds no % or newline (Slurm reads % in log paths as a pattern)",
      "choose a folder name without them", scope="launch")
def _run_dir(cfg: RunConfig, _host: Host) -> Optional[str]:
    bad = [ch for ch in ("%", "\n", "\r") if ch in cfg.run.dir]
    if not bad:
        return None
    return (f"run.dir {cfg.run.dir!r} contains {bad}: Slurm reads % in log paths as a pattern and newlines "
            "break the script")


LAUNCH_RULES = [
    _account, _time_limit, _preempt_signal, _preempt_lead, _max_restarts, _launcher, _gpu_request, _cpus, _mem, _extra_format,
    _extra_owned, _env_name, _container_chosen, _container_image, _mount_syntax, _mount_source, _workdir, _run_dir_mounted, _run_dir,
]
