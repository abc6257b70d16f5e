"""On a real Slurm: a 2-node cluster on this machine (slurm/local_cluster.sh, NODES=2, PYXIS_STUB=1).

The fixture brings the cluster up (installing Slurm with apt the first time) and takes it down again.
Jobs are submitted through the CLI exactly as a user would: a probe (rendezvous + all-reduce across both
nodes, through the pyxis flags), the tiny CPU recipe across 2 nodes x 1 rank, and a preemption: USR1 to
the batch shell -> checkpoint -> requeue -> the second run resumes from that step and finishes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch_support import REPO, cpu_overrides, hydra_list, hydra_str

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CLUSTER_SCRIPT = REPO / "slurm" / "local_cluster.sh"
NEEDS_TRAINER = pytest.mark.skipif(
    importlib.util.find_spec("megatron_recipes.train") is None,
    reason="the trainer (megatron_recipes.train) is not in this checkout yet",
)
# Small but real: 2 ranks (DP=2 across the two nodes), checkpoints, validation.
TRAIN = ["optimizer.lr_warmup_iters=5", "logging.log_interval=5", "logging.eval_interval=10", "logging.eval_iters=1", "logging.plot=false"]


@pytest.fixture(scope="module")
def slurm_cluster():
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root: it installs and starts munged/slurmctld/slurmd")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("slurmctld is not installed and apt-get is not available to install it")
    env = dict(os.environ, NODES="2", PYXIS_STUB="1")
    env.pop("SLURM_LOCAL_DIR", None)  # the script's own folder: `down` must find what `up` started
    state = Path("/tmp/megatron-recipes-slurm")
    up = subprocess.run(["bash", str(CLUSTER_SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=1200)
    if up.returncode != 0:
        apt_log = state / "log" / "apt.log"
        detail = (apt_log.read_text()[-2000:] if apt_log.exists() else "") + up.stderr[-2000:]
        if up.returncode == 3 or shutil.which("slurmctld") is None:
            pytest.skip(f"slurmctld could not be installed on this machine:\n{detail}")
        pytest.fail(f"the local Slurm cluster did not start:\n{up.stdout}\n{detail}")
    yield state
    subprocess.run(["bash", str(CLUSTER_SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=120)


def _env() -> dict:
    """sbatch passes the submitter's environment on: put this interpreter's bin first (container lane: `python`)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("SLURM_RESTART_COUNT", None)
    return env


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_recipes.cli", "slurm", *args], env=_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _job_id(res: subprocess.CompletedProcess) -> str:
    match = re.search(r"submitted job (\d+)", res.stdout)
    assert match, res.stdout + res.stderr
    return match.group(1)


def _job(job_id: str) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _node_logs(run_dir: Path, job_id: str, restart: int) -> list:
    return sorted((run_dir / "slurm" / job_id / f"restart-{restart}").glob("node*.log"))


def _wait_for(predicate, timeout: float, what: str, poll: float = 1.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def _logged_steps(run_dir: Path) -> list:
    """Steps of the DLLogger-format LOG records in run.dir/log.jsonl (METADATA lines have none)."""
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if r.get("type") == "LOG" and isinstance(r.get("step"), int)]


def _explain(run_dir: Path, job_id: str, state: Path | None = None) -> str:
    """The job's record, its batch and node logs and, given the cluster's folder, what Slurm logged about it."""
    job = _job(job_id)
    texts = [" ".join(f"{k}={job.get(k)}" for k in ("JobState", "Reason", "ExitCode", "Restarts", "BeginTime"))]
    texts += [p.read_text()[-3000:] for p in sorted((run_dir / "slurm").glob(f"*-{job_id}.out"))]
    texts += [f"--- {p}\n" + p.read_text()[-3000:] for p in sorted((run_dir / "slurm").glob(f"{job_id}/restart-*/*.log"))]
    if state is not None:
        for log in sorted((state / "log").glob("slurm*.log")):
            lines = [line for line in log.read_text(errors="replace").splitlines() if re.search(rf"\b{job_id}\b", line)]
            texts.append(f"--- {log.name}\n" + "\n".join(lines[-20:]))
    return "\n".join(texts)


def test_probe_joins_both_nodes_through_pyxis_flags(slurm_cluster, tmp_path):
    """Rendezvous across 2 nodes, with container flags whose paths hold spaces and quotes (pyxis stub)."""
    run_dir = tmp_path / "probe run 'q'"
    run_dir.mkdir()
    image = tmp_path / "image 1.sqsh"
    image.write_bytes(b"hsqs")
    overrides = cpu_overrides(
        run_dir,
        f"cluster.container_image={hydra_str(str(image))}",
        "cluster.container_mounts=" + hydra_list([f"{run_dir}:{run_dir}"]),
    )
    res = _cli("submit", "tiny_llama_cpu", *overrides, "--probe", "--wait", timeout=300)
    job_id = _job_id(res)
    assert res.returncode == 0, res.stdout + res.stderr + _explain(run_dir, job_id)
    logs = "\n".join(p.read_text() for p in _node_logs(run_dir, job_id, 0))
    assert "[probe] ok: world=2 ranks on 2 node(s) ['n1', 'n2']" in logs
    # one rendezvous: both nodes used the same endpoint and id; node 0 hosted the store
    execs = re.findall(r"node (\d) \((n\d)\) exec: .*--rdzv-endpoint=(\S+) --rdzv-id=(\d+) --rdzv-conf=is_host=(\w+)", logs)
    assert sorted(execs) == [("0", "n1", f"n1:{20000 + int(job_id)}", job_id, "true"),
                             ("1", "n2", f"n1:{20000 + int(job_id)}", job_id, "false")]


@NEEDS_TRAINER
def test_tiny_recipe_trains_across_two_nodes(slurm_cluster, tmp_path):
    run_dir = tmp_path / "train run"
    overrides = cpu_overrides(run_dir, "train.train_iters=20", "checkpoint.save_interval=10", *TRAIN)
    res = _cli("submit", "tiny_llama_cpu", *overrides, "--wait", timeout=600)
    job_id = _job_id(res)
    assert res.returncode == 0, res.stdout + res.stderr + _explain(run_dir, job_id)
    assert f"job {job_id} finished with exit code 0" in res.stdout
    node_logs = [p.read_text() for p in _node_logs(run_dir, job_id, 0)]
    assert len(node_logs) == 2
    # torchrun's rendezvous result on each node: one group of 2, one node got group rank 0, the other 1
    ranks = sorted(int(m) for text in node_logs for m in re.findall(r"group_rank=(\d+)", text)[:1])
    assert ranks == [0, 1], _explain(run_dir, job_id)
    assert all("group_world_size=2" in text for text in node_logs)
    text = "\n".join(node_logs)
    assert "DP=2 on 2 rank(s)" in text
    assert _logged_steps(run_dir)[-1] == 20
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert (run_dir / "checkpoints" / "iter_0000020").is_dir()
    # the resolved recipe and the script sit next to the job's logs
    assert (run_dir / "slurm" / job_id / "config.yaml").is_file()
    assert (run_dir / "slurm" / job_id / "sbatch.sh").is_file()


@NEEDS_TRAINER
def test_preemption_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    run_dir = tmp_path / "preempt run 'p'"
    total = 60
    overrides = cpu_overrides(run_dir, f"train.train_iters={total}", "checkpoint.save_interval=50", *TRAIN)
    res = _cli("submit", "tiny_llama_cpu", *overrides, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id = _job_id(res)
    try:
        log = run_dir / "log.jsonl"

        def trained_a_little():
            return log.exists() and any(step >= 10 for step in _logged_steps(run_dir))

        _wait_for(trained_a_little, 240, "the first run to reach step 10")
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)

        def requeued():
            job = _job(job_id)
            return job if job.get("Restarts") == "1" else None

        _wait_for(requeued, 180, "the job to requeue itself", poll=0.5)

        def restarted():
            # Slurm holds a requeued job until its old credential expires (AuthInfo=cred_expire, 10 s in
            # slurm/local_cluster.sh); forcing an earlier start races slurmd ("Job credential revoked").
            job = _job(job_id)
            return job if job.get("JobState") not in ("PENDING", "COMPLETING", "REQUEUED", "REQUEUE_FED") else None

        _wait_for(restarted, 120, "the requeued job to start again", poll=0.5)
        final = _wait_for(lambda: _job(job_id) if _job(job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED",
                                                                                     "TIMEOUT", "NODE_FAIL") else None,
                          400, "the requeued run to finish")
    except BaseException:
        subprocess.run(["scancel", job_id])
        print(_explain(run_dir, job_id, slurm_cluster))
        raise
    assert final["JobState"] == "COMPLETED" and final["ExitCode"] == "0:0", _explain(run_dir, job_id, slurm_cluster)
    assert final["Restarts"] == "1"
    batch_log = (run_dir / "slurm" / f"tiny_llama_cpu-{job_id}.out").read_text()
    assert "got USR1" in batch_log and f"requeueing job {job_id}" in batch_log
    stopped = int(re.search(r'preempted: \{\s*"step": (\d+)', batch_log).group(1))
    assert 10 <= stopped < total
    first = "\n".join(p.read_text() for p in _node_logs(run_dir, job_id, 0))
    second = "\n".join(p.read_text() for p in _node_logs(run_dir, job_id, 1))
    assert f"checkpoint at step {stopped} written" in first
    assert f"steps {stopped} -> {total}" in second, _explain(run_dir, job_id)  # resumed, not restarted
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(total)
    assert not (run_dir / "preempted.json").exists()  # the second run cleared it and was not preempted
    assert _logged_steps(run_dir)[-1] == total
