"""What a rank forked from the ranks' server (runtime/ranks.py) starts with. It should not import again what
every rank of its job needs. A fine-tuning rank loads a Hugging Face tokenizer (transformers), and an MoE rank
calls torch.compile'd code on every forward (megatron-core's router), which imports Inductor (~0.7 s of CPU per
rank). The launcher asks for those imports when the job needs them. It finds the recipe its launcher composed, and
it handles signals as a rank torchrun started, whatever its launcher inherited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from megatron_recipes.runtime import ranks

PROBE = textwrap.dedent("""
    import json, sys
    names = sys.argv[2:]
    open(sys.argv[1], "w").write(json.dumps({name: name in sys.modules for name in names}))
""")

START = textwrap.dedent("""
    import json, os, sys
    from megatron_recipes.runtime import ranks
    script, out, asked = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    env = {k: v for k, v in os.environ.items() if k not in ranks.LAUNCHER_VARS}
    names = ranks.TOKENIZER_PRELOAD + ranks.COMPILE_PRELOAD
    job = ranks.start((script,), (out, *names), env, None, 1, **asked)
    sys.exit(job.wait(timeout=120))
""")


SIGNALS = textwrap.dedent("""
    import json, signal, sys
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    open(sys.argv[1], "w").write(json.dumps({n: str(signal.getsignal(getattr(signal, n))) for n in names}))
""")


def _ignore_interrupts() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a command run in the background (`cmd &`) starts with
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def _imported_at_rank_start(tmp_path, probe: str = PROBE, **asked) -> dict:
    """In a fresh process (one server per process): which of the optional preloads a forked rank finds imported
    (or what ``probe`` writes), the process started as a command run in the background."""
    script, out = tmp_path / "probe.py", tmp_path / "seen.json"
    script.write_text(probe)
    done = subprocess.run([sys.executable, "-c", START, str(script), str(out), json.dumps(asked)], capture_output=True,
                          text=True, timeout=300, preexec_fn=_ignore_interrupts)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_job_that_compiles_and_tokenizes_finds_inductor_and_the_tokenizer_loading_imported(tmp_path):
    seen = _imported_at_rank_start(tmp_path, tokenizers=True, compiles=True)
    assert seen and all(seen.values()), seen
    assert set(seen) == set(ranks.TOKENIZER_PRELOAD + ranks.COMPILE_PRELOAD)


def test_a_rank_of_a_launcher_run_in_the_background_stops_on_ctrl_c_as_a_torchrun_rank(tmp_path):
    """A launcher started with SIGINT ignored still passes the user's Ctrl-C on (runtime/local_launch.py): its ranks
    must act on it (KeyboardInterrupt: the trainer says where the next start resumes), not run on until killed."""
    import signal

    seen = _imported_at_rank_start(tmp_path, SIGNALS)
    assert seen == {"SIGINT": str(signal.default_int_handler), "SIGTERM": str(signal.SIG_DFL),
                    "SIGHUP": str(signal.SIG_DFL), "SIGQUIT": str(signal.SIG_DFL)}


def test_an_moe_recipe_asks_its_launcher_for_the_compile_preload(monkeypatch):
    from megatron_recipes.runtime import local_launch
    from megatron_recipes.training import cli

    asked = []
    monkeypatch.setattr(local_launch, "spawn_local", lambda argv, nproc, **kw: asked.append((nproc, kw)) or 0)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    small = ["cluster.gpus_per_node=2", "cluster.nvlink_domain=2", "parallel.sp=true", "train.train_iters=2"]
    assert cli.main(["tiny_llama_cpu", "model=tiny_moe", *small]) == 0
    assert cli.main(["tiny_llama_cpu", *small]) == 0
    assert asked == [(2, {"tokenizers": False, "compiles": True}), (2, {"tokenizers": False, "compiles": False})]


COMPOSES = textwrap.dedent("""
    import json, sys
    from megatron_recipes.config import compose
    fresh = []
    compose_anew = compose._compose_recipe
    compose._compose_recipe = lambda recipe, overrides: fresh.append(recipe) or compose_anew(recipe, overrides)
    cfg = compose.compose_recipe(sys.argv[2], sys.argv[3:])
    open(sys.argv[1], "w").write(json.dumps({"composed_anew": bool(fresh), "train_iters": cfg.train.train_iters}))
""")


def _rank_composes(tmp_path, recipe: str, *overrides: str) -> dict:
    script, out = tmp_path / "composes.py", tmp_path / "composed.json"
    script.write_text(COMPOSES)
    env = {k: v for k, v in os.environ.items() if k not in ranks.LAUNCHER_VARS}
    assert ranks.start((str(script),), (str(out), recipe, *overrides), env, None, 1).wait(timeout=120) == 0
    return json.loads(out.read_text())


def test_a_rank_finds_the_recipe_its_launcher_composed_and_composes_a_changed_one_anew(tmp_path):
    from megatron_recipes.config.compose import compose_recipe

    compose_recipe("tiny_llama_cpu", ["train.train_iters=7"])
    assert _rank_composes(tmp_path, "tiny_llama_cpu", "train.train_iters=7") == {"composed_anew": False, "train_iters": 7}
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults: [tiny_llama_cpu, _self_]\ntrain:\n  train_iters: 5\n")
    assert compose_recipe(str(recipe)).train.train_iters == 5
    recipe.write_text("defaults: [tiny_llama_cpu, _self_]\ntrain:\n  train_iters: 6\n")  # edited after the launcher read it
    assert _rank_composes(tmp_path, str(recipe)) == {"composed_anew": True, "train_iters": 6}


NESTED = textwrap.dedent("""
    import json, os, sys
    from multiprocessing import forkserver
    from megatron_recipes.runtime import ranks

    def main():
        if sys.argv[1] == "inner":
            print(json.dumps({"inner_parent": os.getppid()}), flush=True)
            return
        env = {k: v for k, v in os.environ.items() if k not in ranks.LAUNCHER_VARS}
        code = ranks.start((__file__,), ["inner"], env, None, 1).wait(timeout=120)
        own = forkserver._forkserver._forkserver_pid
        print(json.dumps({"outer_parent": os.getppid(), "code": code, "own_server": own}), flush=True)

    if __name__ == "__main__":
        main()
""")


def test_a_command_forked_from_the_server_forks_its_ranks_there_and_they_write_to_its_output(tmp_path):
    """A command run as one of the server's ranks (tests/cli_support.py runs the CLI so) starts its own ranks
    through the same server, not a second one (a fresh interpreter importing torch and megatron-core again), and
    a rank without a log writes to its launcher's output as it is now. Before: the stdlib started a second
    server, and such a rank wrote where the first server's starter wrote when it started."""
    script = tmp_path / "nested.py"
    script.write_text(NESTED)
    with open(tmp_path / "out", "w+b") as out, open(tmp_path / "err", "w+b") as err:
        env = {k: v for k, v in os.environ.items() if k not in ranks.LAUNCHER_VARS}
        code = ranks.start((str(script),), ["outer"], env, None, 1, output=(out.fileno(), err.fileno())).wait(timeout=180)
    written = (tmp_path / "out").read_text()
    assert code == 0, written + (tmp_path / "err").read_text()
    records = {}
    for line in written.splitlines():
        records.update(json.loads(line))
    assert records.get("code") == 0 and records["own_server"] is None, written
    assert records.get("inner_parent") == records["outer_parent"], written  # forked by the outer command's server
