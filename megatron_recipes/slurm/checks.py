"""Cluster settings that would fail only after the job waited in the queue: caught before submission.

Each check returns ``Violation``s (the recipe validator's type) naming the field, the rule and a fix;
``validate_for_launch`` runs the recipe's own rule table first (layout, batch, precision vs GPU) and
then these, and raises one ``ValidationError`` listing everything.
"""

from __future__ import annotations

import importlib
import re
import signal
from typing import Callable, List, Optional

from megatron_recipes.config import derived
from megatron_recipes.config.errors import ValidationError, Violation
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.slurm import container

LAUNCHERS = ("torchrun", "pmix")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Options the recipe owns: set through cluster.* so the layout, the rendezvous and the requeue agree.
_OWNED = {
    "--nodes": "cluster.nodes", "-N": "cluster.nodes", "--ntasks-per-node": "cluster.gpus_per_node/launcher",
    "--ntasks": "cluster.nodes/gpus_per_node", "-n": "cluster.nodes/gpus_per_node",
    "--gpus-per-node": "cluster.gpus_per_node", "--gres": "cluster.gpus_per_node",
    "--cpus-per-task": "cluster.cpus_per_task", "-c": "cluster.cpus_per_task",
    "--time": "cluster.time_limit", "-t": "cluster.time_limit", "--account": "cluster.account",
    "-A": "cluster.account", "--partition": "cluster.partition", "-p": "cluster.partition",
    "--signal": "cluster.preempt_signal/preempt_signal_lead_s", "--requeue": "(always set)",
    "--no-requeue": "cluster.max_restarts=0", "--output": "run.dir", "-o": "run.dir", "--error": "run.dir",
    "-e": "run.dir", "--job-name": "run.name", "-J": "run.name", "--mpi": "cluster.launcher",
    "--kill-on-bad-exit": "(always 1)", "--container-image": "cluster.container_image",
    "--container-mounts": "cluster.container_mounts", "--container-workdir": "cluster.container_workdir",
}
_FORBIDDEN_SIGNALS = ("SIGKILL", "SIGSTOP")


def time_limit_seconds(text: str) -> Optional[int]:
    """Slurm's time formats -> seconds; None for unlimited; raises ValueError if unreadable."""
    t = str(text).strip()
    if t.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.match(t)
    if not m:
        raise ValueError(t)
    days, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = (nums + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if len(nums) == 1:
        return nums[0] * 60  # M
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]  # M:S
    return (nums[0] * 60 + nums[1]) * 60 + nums[2]  # H:M:S


def signal_name(text: str) -> Optional[str]:
    """'USR1' / 'SIGUSR1' / '10' -> 'USR1' (Slurm's spelling), None if not a signal."""
    t = str(text).strip().upper()
    try:
        sig = signal.Signals(int(t)) if t.isdigit() else signal.Signals[t if t.startswith("SIG") else "SIG" + t]
    except (KeyError, ValueError):
        return None
    return None if sig.name in _FORBIDDEN_SIGNALS else sig.name[3:]


def _v(rule_id: str, fields: List[str], message: str, fix: str) -> Violation:
    return Violation(rule_id=rule_id, fields=fields, message=message, fix=fix)


def _account(cfg: RunConfig, _paths: bool) -> List[Violation]:
    c = cfg.cluster
    missing = [f for f in ("account", "partition") if c.require_account and not getattr(c, f)]
    if not missing:
        return []
    return [_v("slurm.account", [f"cluster.{f}" for f in missing],
               f"cluster {c.name} requires an account and a partition (cluster.require_account=true) "
               f"but {' and '.join('cluster.' + f for f in missing)} is unset",
               " ".join(f"cluster.{f}=<your {f}>" for f in missing))]


def _time(cfg: RunConfig, _paths: bool) -> List[Violation]:
    c = cfg.cluster
    out = []
    try:
        limit = time_limit_seconds(c.time_limit)
    except ValueError:
        return [_v("slurm.time_limit", ["cluster.time_limit"], f"cluster.time_limit='{c.time_limit}' is not a Slurm time",
                   "use HH:MM:SS, D-HH:MM:SS or minutes, e.g. cluster.time_limit=04:00:00")]
    sig = signal_name(c.preempt_signal)
    if sig is None:
        out.append(_v("slurm.preempt_signal", ["cluster.preempt_signal"],
                      f"cluster.preempt_signal='{c.preempt_signal}' is not a signal the job can trap",
                      "use USR1 (default), USR2 or TERM"))
    lead = c.preempt_signal_lead_s
    if lead < 1 or lead > 65535 or (limit is not None and lead >= limit):
        bound = f"below the time limit ({limit} s) and " if limit is not None else ""
        out.append(_v("slurm.preempt_lead", ["cluster.preempt_signal_lead_s", "cluster.time_limit"],
                      f"cluster.preempt_signal_lead_s={lead} must be {bound}between 1 and 65535 seconds",
                      "leave time for one checkpoint save, e.g. cluster.preempt_signal_lead_s=300"))
    if c.max_restarts < 0:
        out.append(_v("slurm.max_restarts", ["cluster.max_restarts"], f"cluster.max_restarts={c.max_restarts} is negative",
                      "use 0 (never requeue) or more"))
    return out


def _shape(cfg: RunConfig, _paths: bool) -> List[Violation]:
    c, out = cfg.cluster, []
    if c.launcher not in LAUNCHERS:
        out.append(_v("slurm.launcher", ["cluster.launcher"], f"cluster.launcher='{c.launcher}' is not one of {LAUNCHERS}",
                      "torchrun (one task per node, c10d rendezvous) or pmix (one task per GPU, srun --mpi=pmix)"))
    if c.cpus_per_task is not None and c.cpus_per_task < c.gpus_per_node:
        out.append(_v("slurm.cpus", ["cluster.cpus_per_task", "cluster.gpus_per_node"],
                      f"cluster.cpus_per_task={c.cpus_per_task} CPUs per node cannot feed {c.gpus_per_node} ranks",
                      f"cluster.cpus_per_task >= {c.gpus_per_node}, or null for Slurm's default"))
    world, mp = derived.world_size(cfg), derived.model_parallel_size(cfg)
    if c.nodes >= 1 and c.gpus_per_node >= 1 and mp >= 1 and world % mp:
        per_node = c.gpus_per_node
        good = [n for n in range(1, 4 * max(c.nodes, 1) + 1) if (n * per_node) % mp == 0][:6]
        out.append(_v("slurm.nodes", ["cluster.nodes", "cluster.gpus_per_node"],
                      f"cluster.nodes={c.nodes} x gpus_per_node={per_node} = {world} ranks is not a multiple of "
                      f"tp*pp*cp = {mp}", f"cluster.nodes in {good}" if good else "change the layout"))
    return out


def _option_name(arg: str) -> str:
    text = arg.strip()
    if text.startswith("#SBATCH"):
        text = text[len("#SBATCH"):].strip()
    return text.split("=", 1)[0].split()[0] if text else ""


def _extras(cfg: RunConfig, _paths: bool) -> List[Violation]:
    out = []
    for field, items in (("cluster.sbatch_extra", cfg.cluster.sbatch_extra), ("cluster.srun_extra", cfg.cluster.srun_extra)):
        for item in items:
            name = _option_name(str(item))
            if not name.startswith("-") or "\n" in str(item):
                out.append(_v("slurm.extra_format", [field], f"{field} item {item!r} is not one option",
                              "one option per list item, e.g. ['--qos=high', '--constraint=ib']"))
            elif name in _OWNED:
                out.append(_v("slurm.extra_owned", [field],
                              f"{field} sets {name}, which the recipe controls through {_OWNED[name]}",
                              f"remove it from {field} and set {_OWNED[name]} instead"))
    for key in cfg.cluster.env:
        if not _ENV_NAME.match(str(key)):
            out.append(_v("slurm.env_name", ["cluster.env"], f"cluster.env key '{key}' is not a variable name",
                          "letters, digits and _ only, not starting with a digit"))
    return out


def _container(cfg: RunConfig, check_paths: bool) -> List[Violation]:
    c, out = cfg.cluster, []
    if not c.container_image:
        if c.container_mounts or c.container_workdir:
            set_ = [f for f in ("container_mounts", "container_workdir") if getattr(c, f)]
            out.append(_v("slurm.container_image", ["cluster.container_image"] + [f"cluster.{f}" for f in set_],
                          f"{', '.join('cluster.' + f for f in set_)} asks for pyxis but cluster.container_image is unset",
                          "cluster.container_image=/path/to/image.sqsh (see slurm/README.md: enroot import), "
                          "or clear the container settings to run without a container"))
        return out
    image = c.container_image
    if container.image_is_local_file(image) and check_paths and container.missing_on_this_host(image):
        out.append(_v("slurm.container_image", ["cluster.container_image"], f"image file '{image}' does not exist",
                      "check the path, or create it with `enroot import -o IMAGE.sqsh dockerd://IMAGE:TAG`"))
    mounts = []
    for entry in c.container_mounts:
        try:
            mount = container.parse_mount(entry)
        except container.MountError as exc:
            out.append(_v("slurm.mount_syntax", ["cluster.container_mounts"], str(exc),
                          "write each mount as '/abs/source:/abs/target[:ro]', one list item per mount"))
            continue
        mounts.append(mount)
        if check_paths and container.missing_on_this_host(mount.source):
            out.append(_v("slurm.mount_source", ["cluster.container_mounts"],
                          f"mount source '{mount.source}' does not exist on this host",
                          "fix the path (or pass --skip-path-checks when rendering away from the cluster)"))
    if c.container_workdir and not c.container_workdir.startswith("/"):
        out.append(_v("slurm.workdir", ["cluster.container_workdir"],
                      f"cluster.container_workdir='{c.container_workdir}' is not an absolute path", "use an absolute path"))
    if len(mounts) == len(c.container_mounts) and not container.inside_any_mount(cfg.run.dir, mounts):
        out.append(_v("slurm.run_dir_mounted", ["run.dir", "cluster.container_mounts"],
                      f"run.dir '{cfg.run.dir}' is not under any container mount: checkpoints and logs would "
                      "vanish with the container", f"add a mount for it, e.g. cluster.container_mounts=['{cfg.run.dir}']"))
    return out


def _run_dir(cfg: RunConfig, _paths: bool) -> List[Violation]:
    bad = [ch for ch in ("%", "\n", "\r") if ch in cfg.run.dir]
    if not bad:
        return []
    return [_v("slurm.run_dir", ["run.dir"], f"run.dir {cfg.run.dir!r} contains {bad}: Slurm reads % in log paths "
               "as a pattern and newlines break the script", "choose a folder name without them")]


LAUNCH_CHECKS: List[Callable[[RunConfig, bool], List[Violation]]] = [
    _account, _time, _shape, _extras, _container, _run_dir,
]


def launch_violations(cfg: RunConfig, check_paths: bool = True) -> List[Violation]:
    return [v for check in LAUNCH_CHECKS for v in check(cfg, check_paths)]


def _recipe_validator():
    """The recipe rule table's entry point, when that module is present in this version."""
    try:
        module = importlib.import_module("megatron_recipes.config.validate")
    except ModuleNotFoundError:
        return None
    return getattr(module, "validate_or_raise", None)


def validate_for_launch(cfg: RunConfig, recipe: str = "recipe", check_paths: bool = True) -> None:
    """Recipe rules, then launch rules; raises ValidationError listing every problem."""
    validate = _recipe_validator()
    if validate is not None:
        validate(cfg, recipe_name=recipe)
    violations = launch_violations(cfg, check_paths)
    if violations:
        raise ValidationError(violations, recipe=recipe)
