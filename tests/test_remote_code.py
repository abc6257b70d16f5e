"""No Hugging Face folder runs its own code: every ``Auto*.from_pretrained`` passes ``trust_remote_code=False``.

A tokenizer folder whose ``tokenizer_config.json`` has an ``auto_map`` makes transformers ask
"[y/N]" on the terminal when ``trust_remote_code`` is left unset, and "y" imports the folder's Python.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE_DIRS = ("megatron_recipes", "benchmarks", "launch")  # tests load models they just wrote


def _auto_from_pretrained_calls():
    for folder in CODE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                func = getattr(node, "func", None)
                if (isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and func.attr == "from_pretrained"
                        and isinstance(func.value, ast.Name) and func.value.id.startswith("Auto")):
                    yield f"{path.relative_to(REPO)}:{node.lineno}", node


def test_every_auto_from_pretrained_refuses_remote_code():
    calls = list(_auto_from_pretrained_calls())
    assert len(calls) >= 4  # tokenizer, config, verify, peft export, benchmark
    bad = [where for where, node in calls
           if not any(k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value is False
                      for k in node.keywords)]
    assert not bad, f"from_pretrained without trust_remote_code=False: {bad}"


def _evil_tokenizer(folder: Path, sentinel: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"a": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="EvilTokenizerFast", auto_map={"AutoTokenizer": [None, "evil.EvilTokenizerFast"]})
    config_path.write_text(json.dumps(config))
    (folder / "evil.py").write_text(
        f"open({str(sentinel)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizerFast(PreTrainedTokenizerFast):\n    pass\n"
    )


def test_tokenizer_with_auto_map_runs_no_code_even_when_answered_yes(tmp_path):
    folder, sentinel = tmp_path / "tok", tmp_path / "SENTINEL"
    _evil_tokenizer(folder, sentinel)
    script = ("import sys\nfrom megatron_recipes.config.errors import RecipeError\n"
              "from megatron_recipes.data.tokenizer import load_tokenizer_dir\n"
              f"try:\n    load_tokenizer_dir({str(folder)!r})\nexcept RecipeError as exc:\n"
              "    print(exc); sys.exit(2)\n")
    res = subprocess.run([sys.executable, "-c", script], input="y\n" * 4, capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert not sentinel.exists(), "the tokenizer folder's own Python ran"
    assert res.returncode == 2 and "cannot load a tokenizer" in res.stdout, res.stdout + res.stderr[-2000:]
