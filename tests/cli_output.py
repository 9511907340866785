"""What a command said on stderr, less its progress log (conveyor.logs' INFO lines: a start
says what it is doing): the one-line errors the CLI promises are the rest."""

from __future__ import annotations

import re

PROGRESS = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO ")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.strip().splitlines() if not PROGRESS.match(line)]
