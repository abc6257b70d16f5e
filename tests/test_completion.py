"""Shell completion: the candidates come from the recipe tree, the schema and each command's own flags,
and the bash script really completes in bash (its completion machinery driven as a terminal would)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_recipes.completion import _keys, candidates, script
from megatron_recipes.config.compose import list_group_options, list_recipes
from megatron_recipes.config.schema import FIELD_VALUES


def test_candidates_follow_the_command_line():
    assert candidates(["pl"]) == ["plan"]
    assert candidates(["plan", "tiny_llama_c"]) == ["tiny_llama_cpu"]
    assert candidates(["slurm", ""]) == ["render", "submit"]
    assert candidates(["slurm", "submit", "llama3_8b_p"]) == ["llama3_8b_pretrain"]
    assert candidates(["plan", "tiny_llama_cpu", "parallel="]) == [f"parallel={o}" for o in list_group_options("parallel")]
    assert candidates(["train", "tiny_llama_cpu", "train.recompute="]) == ["train.recompute=none", "train.recompute=selective",
                                                                          "train.recompute=full"]
    assert candidates(["train", "tiny_llama_cpu", "logging.plot=t"]) == ["logging.plot=true"]
    top = candidates(["train", "tiny_llama_cpu", ""])
    assert "parallel=" in top and "train." in top and not any(c.startswith("train.") and c != "train." for c in top)
    assert "train.train_iters=" in candidates(["train", "tiny_llama_cpu", "train.tr"])
    assert candidates(["plan", "x", "--se"]) == ["--search"] and "-m" in candidates(["train", "x", "-"])
    assert "--dry-run" in candidates(["slurm", "submit", "x", "--d"]) and candidates(["generate", ""]) == []
    assert sorted(candidates(["plan", ""])) == sorted(list_recipes())


def test_every_value_table_names_a_schema_key():
    keys = _keys()
    assert all(key in keys for key in FIELD_VALUES), [k for k in FIELD_VALUES if k not in keys]


def test_completion_answers_without_torch():
    code = ("import sys; from megatron_recipes.cli import main; main(['complete', 'plan', 'tiny_llama_cpu', 'parallel=']);"
            "sys.exit(3 if 'torch' in sys.modules or 'megatron.core' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "parallel=tp2" in done.stdout, done.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_the_bash_script_completes_in_bash(tmp_path):
    entry = Path(sys.executable).parent / "megatron-recipes"
    if not entry.is_file():
        pytest.skip("the console script is not installed beside this Python")
    (tmp_path / "completion.bash").write_text(script("bash"))
    driver = f"""
        export PATH={entry.parent}:$PATH
        source {tmp_path / 'completion.bash'}
        for line in "megatron-recipes plan tiny_llama_cpu parallel=tp" "megatron-recipes pl" "megatron-recipes plan tiny_llama_cpu train.tr"; do
            COMP_LINE="$line"; COMP_POINT=${{#line}}
            _megatron_recipes_complete; printf '%s\\n' "${{COMPREPLY[@]}}"; echo ---
        done
    """
    done = subprocess.run(["bash", "-c", driver], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    after_equals, command, keys = done.stdout.split("---")[:3]
    # bash splits "parallel=tp" at '=' (COMP_WORDBREAKS): the word to complete is "tp"
    assert after_equals.split() == [o for o in list_group_options("parallel") if o.startswith("tp")]
    assert command.split() == ["plan"] and "train.train_iters=" in keys.split()
    assert script("zsh").startswith("# megatron-recipes completion (zsh)") and "bashcompinit" in script("zsh")
