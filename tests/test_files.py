"""The one atomic-write helper (megatron_recipes/files.py): whole files or none, no temporaries left."""

from __future__ import annotations

import pytest

from megatron_recipes import files


def test_write_text_replaces_the_file_and_leaves_nothing_else(tmp_path):
    target = tmp_path / "sub" / "config.yaml"
    files.write_text(target, "a: 1\n")
    files.write_text(target, "a: 2\n")
    assert target.read_text() == "a: 2\n"
    assert [p.name for p in target.parent.iterdir()] == ["config.yaml"]


def test_a_failed_write_keeps_the_old_content_and_removes_its_temporary(tmp_path):
    target = tmp_path / "latest_checkpointed_iteration.txt"
    files.write_text(target, "5\n")
    with pytest.raises(RuntimeError, match="killed"):
        with files.replacing(target) as tmp:
            tmp.write_text("6")  # half of what was meant
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "5\n" and [p.name for p in tmp_path.iterdir()] == [target.name]


# --- the one rule for deleting and overwriting (issue 30, cases 1, 3, 4) ------------------------------
def _special_paths(tmp_path):
    """A path of each kind an atomic rename would destroy: (name, path, how to tell it survived)."""
    import os
    import stat

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    target = tmp_path / "real.html"
    target.write_text("the user's page")
    link = tmp_path / "link.html"
    link.symlink_to(target)
    folder = tmp_path / "folder"
    folder.mkdir()
    found = []
    if os.geteuid() == 0:  # as root `report --out /dev/full` replaced the device node; here a null device of our own
        device = tmp_path / "null"
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        found.append(("device node", device, lambda: stat.S_ISCHR(os.lstat(device).st_mode)))
    return found + [
        ("named pipe", fifo, lambda: stat.S_ISFIFO(os.lstat(fifo).st_mode)),
        ("symbolic link", link, lambda: link.is_symlink() and target.read_text() == "the user's page"),
        ("folder", folder, lambda: folder.is_dir()),
    ]


def test_an_atomic_write_never_replaces_what_is_not_a_regular_file(tmp_path):
    # Before: os.replace turned a FIFO, a symlink (or, as root, /dev/full) into a regular file.
    from megatron_recipes.config.errors import RecipeError

    for kind, path, survived in _special_paths(tmp_path):
        with pytest.raises(RecipeError, match=kind) as err:
            files.write_text(path, "new")
        assert "regular files" in err.value.message and err.value.fix and survived(), kind
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_report_out_refuses_a_fifo_a_symlink_and_a_folder(tmp_path, capsys):
    from megatron_recipes.cli import main as cli_main
    from megatron_recipes.config.compose import compose_recipe, to_yaml

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(compose_recipe("tiny_llama_cpu", [f"run.dir={run}"])))
    for kind, path, survived in _special_paths(tmp_path):
        assert cli_main(["report", str(run), "--out", str(path)]) == 2, kind
        err = capsys.readouterr().err
        assert kind in err and "fix:" in err and "Traceback" not in err and survived(), err


def test_a_folder_is_removable_only_when_empty_or_marked_as_the_tools(tmp_path):
    from megatron_recipes.config.errors import RecipeError

    files.check_removable(tmp_path / "absent", "check", "--dir")
    empty = tmp_path / "empty"
    empty.mkdir()
    files.check_removable(empty, "check", "--dir")
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    with pytest.raises(RecipeError, match="not a check output"):
        files.check_removable(user, "check", "--dir")
    with pytest.raises(RecipeError, match="not a check output"):
        files.fresh_own_dir(user, "check", "--dir")
    assert (user / "thesis.tex").exists()
    ours = files.fresh_own_dir(tmp_path / "ours", "hf export", "hf_dir")
    with pytest.raises(RecipeError, match="not a check output"):  # another command's output is not this one's
        files.check_removable(ours, "check", "--dir")
    (ours / files.OWN_MARKER).write_text("{not json")
    assert files.own_kind(ours) is None
    with pytest.raises(RecipeError, match="upward"):
        files.check_removable(tmp_path / "ours" / "..", "check", "--dir")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(RecipeError, match="not a folder"):
        files.check_removable(a_file, "check", "--dir")


def test_an_output_folder_may_not_hold_the_commands_inputs(tmp_path):
    from megatron_recipes.config.errors import RecipeError

    (tmp_path / "hfx" / "megatron").mkdir(parents=True)
    with pytest.raises(RecipeError, match="holds the input ckpt_dir") as err:
        files.require_outside(tmp_path / "hfx", {"ckpt_dir": tmp_path / "hfx" / "megatron"}, "hf_dir")
    assert "outside ckpt_dir" in err.value.fix
    with pytest.raises(RecipeError, match="holds the input"):
        files.require_outside(tmp_path / "hfx", {"ckpt_dir": tmp_path / "hfx"}, "hf_dir")
    files.require_outside(tmp_path / "hfx" / "megatron" / "hf", {"ckpt_dir": tmp_path / "hfx" / "megatron", "x": None}, "hf_dir")
    files.require_outside(tmp_path / "hf", {"ckpt_dir": tmp_path / "hfx"}, "hf_dir")  # a sibling with a longer name
