"""`vlm-assets --help` and `--version`: every command, however deep, says what it is for."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys

import pytest

from vlm_assets.cli import main

# A command in its parent's list: four spaces, the name, then its help on the same line or the next.
COMMAND_LINE = re.compile(r"^    ([a-z]+)(?: {2,}(\S.*))?$")


def help_text(command: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def listed_commands(help_: str) -> dict[str, str]:
    """The commands a help lists (under its COMMAND argument) with their help lines."""
    lines = help_.splitlines()
    commands = {}
    for number, line in enumerate(lines):
        match = COMMAND_LINE.match(line)
        if match:
            following = lines[number + 1] if number + 1 < len(lines) else ""
            commands[match.group(1)] = match.group(2) or (following.strip() if following.startswith(" " * 6) else "")
    return commands


def description(help_: str) -> str:
    """The paragraph after the usage lines, unless it is already the list of arguments."""
    paragraphs = help_.split("\n\n")
    following = paragraphs[1].strip() if len(paragraphs) > 1 else ""
    return "" if following.endswith(":") or following.startswith(("positional arguments:", "options:")) else following


def test_every_command_has_a_help_line_and_a_description(capsys):
    commands = listed_commands(help_text([], capsys))
    assert {"run", "demo", "package", "frames", "worker"} <= set(commands)
    unexplained, undescribed = [], []
    pending = [([name], text) for name, text in commands.items()]
    while pending:
        command, text = pending.pop()
        if not text:
            unexplained.append(" ".join(command))
        help_ = help_text(command, capsys)
        if not description(help_):
            undescribed.append(" ".join(command))
        pending += [([*command, name], text) for name, text in listed_commands(help_).items()]
    assert not unexplained, f"listed without a help line: {unexplained}"
    assert not undescribed, f"--help without a description: {undescribed}"


def test_version_prints_the_installed_version():
    result = subprocess.run([sys.executable, "-m", "vlm_assets.cli", "--version"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"vlm-assets {importlib.metadata.version('vlm-assets')}"
