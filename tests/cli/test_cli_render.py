"""Output details: colour only on a terminal and without NO_COLOR, the progress bar, the
installed console scripts."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from clikit import pristine

from mpickpt.cli import EXIT_OK
from mpickpt.cli.render import Cell, Out, Progress, human_age, human_bytes


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_only_on_a_terminal_and_not_with_no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        Out(stream=stream).table(["A", "STATUS"], [["1", Cell("corrupt", "red")]])
    assert "\033[31mcorrupt\033[0m" in tty.getvalue()
    assert "\033[" not in pipe.getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    tty = Tty()
    Out(stream=tty).table(["A", "STATUS"], [["1", Cell("corrupt", "red")]])
    assert "\033[" not in tty.getvalue()


@pytest.mark.quick
def test_table_aligns_on_the_text_not_the_escape_codes(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    tty = Tty()
    Out(stream=tty).table(["STEP", "STATUS", "NOTE"],
                          [["5", Cell("committed", "green"), "x"], ["10", "corrupt", "y"]],
                          right=(0,))
    plain = [line.replace("\033[32m", "").replace("\033[0m", "").replace("\033[1m", "")
             for line in tty.getvalue().splitlines()]
    assert plain == ["STEP  STATUS     NOTE", "   5  committed  x", "  10  corrupt    y"]


def test_progress_bar_only_on_a_terminal():
    tty = Tty()
    p = Progress("verifying", 2_000_000, tty)
    p.add(1_000_000)
    p.close()
    assert "verifying [" in tty.getvalue() and "2.0 MB" in tty.getvalue()
    assert "/s" in tty.getvalue() and tty.getvalue().endswith("\n")
    pipe = io.StringIO()
    p = Progress("verifying", 10, pipe)
    p.add(10)
    p.close()
    assert pipe.getvalue() == ""


@pytest.mark.quick
def test_human_units():
    assert human_bytes(999) == "999 B" and human_bytes(453_852) == "453.9 kB"
    assert human_bytes(3.2e12) == "3.2 TB"
    assert human_age(30) == "30 s ago" and human_age(7500) == "2 h 5 min ago"
    assert human_age(3 * 86400 + 3600) == "3 d 1 h ago"


@pytest.mark.parametrize("script", ["mpickpt-restore", "mpickpt"])
def test_console_scripts_are_installed(tmp_path_factory, script):
    exe = Path(sys.executable).parent / script
    if not exe.exists():
        pytest.fail(f"{exe} is missing: install the package (pip install -e .)")
    root = pristine(1, tmp_path_factory)
    argv = [str(exe), str(root), "--list", "--json"] if script == "mpickpt-restore" else [
        str(exe), "ls", str(root), "--json"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert p.returncode == EXIT_OK, p.stderr
    assert json.loads(p.stdout)["current"] == 20
