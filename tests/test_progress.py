"""The progress helper: plain periodic lines off a terminal, a rich bar on one, nothing for short work;
and the commands that use it (convert import/export, plan --search)."""

from __future__ import annotations

import io

from megatron_recipes.progress import Progress, human


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_plain_lines_every_interval_with_rate_and_eta():
    out, clock = io.StringIO(), Clock()
    with Progress("import", total=4e9, unit="B", items_total=40, items_unit="tensors", stream=out,
                  tty=False, interval=10, delay=1, clock=clock) as p:
        for _ in range(40):
            clock.t += 1.0
            p.update(1e8, items=1)
    lines = out.getvalue().splitlines()
    assert lines[0] == "import: 2% 100.00 MB / 4.00 GB, 1 / 40 tensors, 100.00 MB/s, ETA 39 s"
    assert len(lines) == 1 + 3 + 1  # at 1 s, then every 10 s (11, 21, 31), the end
    assert lines[1].startswith("import: 28% 1.10 GB / 4.00 GB, 11 / 40 tensors")
    assert lines[-1] == "import: done, 4.00 GB, 40 tensors in 40 s"


def test_a_stalled_count_prints_once_a_minute_not_every_interval():
    out, clock = io.StringIO(), Clock()
    with Progress("  layout", total=6, unit="steps", stream=out, tty=False, interval=10, delay=0, clock=clock) as p:
        for _ in range(30):  # 5 minutes polled every 10 s with no step done (ranks starting up)
            clock.t += 10.0
            p.update(0)
        clock.t += 10.0
        p.update(6)
    lines = out.getvalue().splitlines()
    assert [line.split(":")[1].split()[0] for line in lines[:-1]] == ["0%"] * 5 + ["100%"]  # 10 s, then 70..250 s
    assert lines[-1] == "  layout: done, 6 steps in 5 min 10 s"


def test_short_work_prints_nothing_and_disabled_prints_nothing():
    out, clock = io.StringIO(), Clock()
    with Progress("export", total=10, stream=out, tty=False, delay=1.5, clock=clock) as p:
        clock.t = 1.0
        p.update(10)
    with Progress("export", total=10, stream=out, tty=False, delay=0, clock=clock, enabled=False) as p:
        clock.t = 100.0
        p.update(10)
    assert out.getvalue() == ""


def test_unknown_total_counts_without_eta():
    out, clock = io.StringIO(), Clock()
    with Progress("plan --search: estimating", unit="layouts", stream=out, tty=False, delay=0, clock=clock) as p:
        clock.t = 2.0
        p.update(500)
    assert out.getvalue().splitlines()[0] == "plan --search: estimating: 500 layouts, 250.0 layouts/s"


def test_terminal_gets_a_rich_bar():
    out, clock = io.StringIO(), Clock()
    with Progress("import", total=1000, unit="B", stream=out, tty=True, delay=0, clock=clock) as p:
        clock.t = 1.0
        p.update(500)
    text = out.getvalue()
    assert "\x1b[" in text and "━" in text and "import" in text  # rich's coloured bar, not plain lines
    assert "50% 500 B / 1.00 kB" in text and "import:" not in text  # the counts beside the bar, no repeated name
    assert human(999) == "999 B" and human(1_500_000) == "1.50 MB"


def test_plan_search_reports_progress_on_stderr_off_a_terminal(capsys, monkeypatch):
    import megatron_recipes.progress as progress
    from megatron_recipes.plan.cli import main

    monkeypatch.setattr(progress, "DELAY_S", 0.0)  # show even quick work, one line per update
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)
    assert main(["llama3_8b_pretrain", "cluster.nodes=2", "--search", "--top", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.out.lstrip().startswith("{")  # stdout stays JSON
    assert "plan --search: estimating:" in captured.err and "plan --search: validating: done" in captured.err


def test_convert_import_and_export_count_tensors_and_bytes(tmp_path, capsys, monkeypatch):
    import megatron_recipes.progress as progress
    from convert_support import make_hf_model
    from megatron_recipes.cli import main

    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    hf = make_hf_model("llama", tmp_path / "hf")
    assert main(["convert", "import", f"hf_dir={hf}", f"out_dir={tmp_path / 'ckpt'}", "--no-verify"]) == 0
    err = capsys.readouterr().err
    done = [line for line in err.splitlines() if line.startswith("import: done, ")]
    assert len(done) == 1 and done[0].endswith(" s") and " tensors in " in done[0], err
    assert main(["convert", "export", f"ckpt_dir={tmp_path / 'ckpt'}", f"hf_dir={tmp_path / 'out'}", "--no-verify"]) == 0
    err = capsys.readouterr().err
    assert any(line.startswith("export: done, ") and " tensors in " in line for line in err.splitlines()), err
