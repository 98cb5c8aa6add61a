"""Every ```python block in README.md and docs/*.md runs as written against the demo's built outputs,
so an example that no longer works fails here rather than for the first reader who pastes it.

A block marked with a `<!-- not executed: reason -->` line just before it is left out: one that needs
what a test cannot have (a bucket on object storage) or stands for arguments with `...`. The mark is in
the document, where the reader sees that the block is a fragment and why.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPOSITORY = Path(__file__).resolve().parents[1]
NOT_EXECUTED = re.compile(r"^<!-- not executed: \S.* -->$")

# The blocks run one after the other in one process, each in a namespace of its own: importing Energon
# (torch) once for all of them takes most of the time.
RUNNER = """
import json, sys, traceback
failures = []
for block in json.load(sys.stdin):
    try:
        exec(compile(block["code"], block["where"], "exec"), {"__name__": "__main__"})
    except BaseException:
        failures.append(block["where"] + ":\\n" + traceback.format_exc())
print("\\n".join(failures), file=sys.stderr)
sys.exit(1 if failures else 0)
"""


@dataclass(frozen=True)
class Block:
    where: str  # file:line of the block's first line of code
    code: str
    executed: bool


def python_blocks(document: Path) -> list[Block]:
    lines = document.read_text(encoding="utf-8").splitlines()
    blocks = []
    number = 0
    while number < len(lines):
        if lines[number].strip() == "```python":
            end = next(index for index in range(number + 1, len(lines)) if lines[index].strip() == "```")
            before = next((line.strip() for line in reversed(lines[:number]) if line.strip()), "")
            blocks.append(Block(f"{document.relative_to(REPOSITORY)}:{number + 2}", "\n".join(lines[number + 1:end]),
                                executed=not NOT_EXECUTED.match(before)))
            number = end
        number += 1
    return blocks


def test_every_python_example_in_the_docs_runs_against_the_demo(reference_run, tmp_path):
    documents = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
    blocks = [block for document in documents for block in python_blocks(document)]
    executed = [block for block in blocks if block.executed]
    assert executed, "no python example found to run"
    # The examples name the demo as scripts/demo.sh leaves it, ./demo from the repository root.
    (tmp_path / "demo").symlink_to(reference_run.config.parent, target_is_directory=True)
    result = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps([vars(block) for block in executed]),
                            capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, f"examples that fail as written:\n{result.stderr[-6000:]}"
