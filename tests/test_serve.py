"""``megatron-recipes serve``: a real HTTP client on localhost against the command as a user starts it
(two torchrun ranks at the run's TP=2 on the CPU lane), answers equal to ``generate``'s, bad requests
refused with one 4xx and a message each, Ctrl-C stopping every rank."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cli_support import run_cli
from finetuned_support import readme_lora

pytestmark = pytest.mark.slow

QUESTIONS = ["What type is [3, 'node']?", "What type is 2.5?", "Which Python type is {'a': 1}?", "What type is 'x'?",
             "What type is (1, 2)?", "What type is 7?", "Which Python type is [0.5]?", "What type is {'k': 'v'}?"]


def _post(base: str, path: str, body, timeout: float = 300):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def server(shared_runs):
    run = readme_lora(shared_runs)
    command = [sys.executable, "-m", "megatron_recipes.cli", "serve", str(run.lora.run_dir), "port=0", "max_tokens=16"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(run.root))
    lines = []
    deadline = time.time() + 300
    base = None
    while time.time() < deadline and base is None:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        found = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", line)
        base = found.group(1) if found else None
    assert base, "".join(lines)[-4000:]
    yield run, base, proc
    if proc.poll() is None:
        proc.kill()


def test_concurrent_requests_get_generates_tokens(server):
    run, base, _ = server
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:  # 8 clients at once: the server batches them
        replies = list(pool.map(lambda q: _post(base, "/chat/completions", {"model": "tiny_llama_lora", "max_tokens": 16,
                                                                           "messages": [{"role": "user", "content": q}]}), QUESTIONS))
    assert all(status == 200 for status, _ in replies), replies
    served = [json.loads(body)["choices"][0] for _, body in replies]
    done = run_cli(["generate", str(run.lora.run_dir), *QUESTIONS, "max_new_tokens=16", "--json"], timeout=600,
                   cwd=str(run.root))
    assert done.returncode == 0, done.stderr[-3000:]
    generated = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [c["token_ids"] for c in served] == [g["tokens"] for g in generated]
    assert [c["message"]["content"] for c in served] == [g["text"] for g in generated]

    status, body = _post(base, "/chat/completions", {"messages": [{"role": "user", "content": QUESTIONS[1]}], "stream": True,
                                                     "max_tokens": 16})
    assert status == 200 and body.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == generated[1]["text"]
    with urllib.request.urlopen(base + "/models", timeout=30) as response:
        assert json.loads(response.read())["data"][0]["id"] == "tiny_llama_lora"


@pytest.mark.parametrize("path,body,status,words", [
    ("/completions", b"{not json", 400, "not JSON"),
    ("/completions", {"model": "other", "prompt": "x"}, 404, "model 'other' is not served"),
    ("/completions", {"prompt": "x", "max_tokens": -3}, 400, "'max_tokens' must be >= 1"),
    ("/completions", {"prompt": "word " * 600}, 400, "exceeds the model's 512 positions"),
    ("/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0]"),
], ids=["malformed-json", "unknown-model", "negative-max-tokens", "oversized-prompt", "bad-message"])
def test_bad_requests_get_one_4xx_with_a_message(server, path, body, status, words):
    _, base, _ = server
    got, text = _post(base, path, body, timeout=60)
    assert got == status, text
    error = json.loads(text)["error"]
    assert words in error["message"] and "Traceback" not in text


def test_lm_evals_openai_client_gets_the_answers_transformers_gives(server, shared_runs, tmp_path):
    """lm-eval's ``local-chat-completions`` model (its OpenAI client, 4 requests at once) against the server:
    the generation task's answers equal lm-eval's hf model's on the merged export."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from finetuned_support import merged_export
    from lm_eval_tasks import GENERATION, write_tasks
    from megatron_recipes.data.sft.builtin_tasks import TYPES, ensure_files

    run, base, _ = server
    _, valid = ensure_files(str(run.cache))
    tasks = write_tasks(tmp_path, Path(valid), ["x = 1\n"], questions=12)

    def answers(model: str, args: str):
        out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=[GENERATION], apply_chat_template=True,
                                      task_manager=TaskManager(include_path=str(tasks), include_defaults=False), log_samples=True)
        return [s["resps"][0][0] for s in sorted(out["samples"][GENERATION], key=lambda s: s["doc_id"])]

    served = answers("local-chat-completions", f"model=tiny_llama_lora,base_url={base}/chat/completions,num_concurrent=4,"
                                               "tokenizer_backend=None")
    theirs = answers("hf", f"pretrained={merged_export(shared_runs)},dtype=float32,device=cpu")
    assert served == theirs and sum(a.strip() in TYPES for a in served) > len(served) // 2, (served, theirs)


def test_ctrl_c_stops_every_rank(server):
    _, base, proc = server
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode in (0, 130), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
