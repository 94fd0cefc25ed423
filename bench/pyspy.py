"""py-spy on a service under load: record its stacks, then say where the time went.

``record`` samples a running process without pausing it (``--nonblocking``: a paused
service would measure the profiler); ``summarize`` reads py-spy's raw (collapsed) output
and ranks functions by the share of samples they were running in (self) and on the stack
(inclusive). Only active threads are sampled, so the shares are of busy time.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

_LINE = re.compile(r"^(.*) (\d+)$")


def record(pid: int, seconds: float, out: Path, rate: int = 100) -> subprocess.Popen[bytes]:
    """Start sampling ``pid`` for ``seconds`` into ``out`` (raw format); wait on the result."""
    if shutil.which("py-spy") is None:
        raise FileNotFoundError("py-spy is not installed (pip install py-spy)")
    command = [
        "py-spy", "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
        "--rate", str(rate), "--format", "raw", "--nolineno", "--nonblocking",
        "--output", str(out),
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


TRUNK_SHARE = 0.9  # frames on nearly every stack (the runner, main): not worth ranking


def frame_name(frame: str) -> str:
    """``func (path/to/pkg/module.py)`` -> ``pkg/module.py:func``: short enough for a table."""
    name, _, where = frame.partition(" (")
    if not where:
        return name
    path = Path(where.rstrip(")"))
    return f"{path.parent.name}/{path.name}:{name}" if path.parent.name else f"{path.name}:{name}"


def summarize(path: Path, top: int = 15) -> dict[str, Any]:
    """The ``top`` functions by self and by inclusive share of the samples, in percent;
    the inclusive ranking leaves out the trunk (frames on more than 90 % of the stacks)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        count = int(match.group(2))
        frames = [frame_name(f) for f in match.group(1).split(";") if f]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count

    def ranked(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(100 * n / total, 1)) for name, n in counter.most_common(top)]

    branches = Counter({k: n for k, n in inclusive.items() if n <= TRUNK_SHARE * total})
    return {"samples": total, "self_pct": ranked(own), "inclusive_pct": ranked(branches)}
