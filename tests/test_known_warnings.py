"""The known third-party warnings are hidden and counted across a command's processes; any other warning shows."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import warnings
    from megatron_recipes.runtime.known_warnings import quiet
    quiet()
    warnings.warn("Apex is not installed. Falling back to Torch Norm")
    warnings.warn("Transformer Engine and Apex are not installed. Falling back")
    warnings.warn("this one is news to us")
""")

PARENT = textwrap.dedent("""
    import subprocess, sys
    from megatron_recipes.runtime import known_warnings
    tally = known_warnings.start_tally()
    known_warnings.quiet()
    import warnings
    warnings.warn("`load_state_dict` is deprecated and will be removed in future versions")
    subprocess.run([sys.executable, "-c", sys.argv[1]], check=True)
    known_warnings.close_tally(tally)
""")


def _run(env_extra=None):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RECIPES_")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", PARENT, CHILD], capture_output=True, text=True, timeout=60, env=env)


def test_known_warnings_of_every_process_are_counted_in_one_line():
    done = _run()
    assert done.returncode == 0, done.stderr
    assert "this one is news to us" in done.stderr  # not listed: shown
    assert "Apex is not installed" not in done.stderr and "load_state_dict" not in done.stderr
    notes = [line for line in done.stderr.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith("note: 3 known third-party warnings hidden"), done.stderr


def test_verbose_shows_them_all():
    done = _run({"MEGATRON_RECIPES_VERBOSE": "1"})
    assert "Apex is not installed" in done.stderr and "load_state_dict" in done.stderr and "note:" not in done.stderr


def test_a_pattern_matches_anywhere_in_the_text():
    from megatron_recipes.runtime.known_warnings import known

    assert known("UserWarning: Apex is not installed. Falling back to Torch Norm") and not known("a new problem")
