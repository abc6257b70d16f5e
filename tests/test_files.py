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
