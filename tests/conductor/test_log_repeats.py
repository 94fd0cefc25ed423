"""A repeated log line is collapsed into a count, per subject, and DEBUG is left alone."""

from __future__ import annotations

import logging
import subprocess
import sys

from conductor.log_repeats import RepeatedLineFilter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(msg: str, *args: object, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("conductor.x", level, __file__, 1, msg, args, None)


def test_a_repeated_line_passes_once_a_window_with_the_count_of_the_dropped() -> None:
    clock = Clock()
    repeats = RepeatedLineFilter(window_s=60.0, clock=clock)
    lost = "stream=%s lost its publisher after %d ms"
    assert repeats.filter(record(lost, "a", 5))
    passed = []
    for step in range(41):
        clock.now = 1.0 + step
        passed.append(repeats.filter(record(lost, "a", step)))
    assert not any(passed)
    clock.now = 61.0
    line = record(lost, "a", 7)
    assert repeats.filter(line)
    assert line.getMessage() == "stream=a lost its publisher after 7 ms (41 more in the last 61 s)"
    clock.now = 62.0
    assert not repeats.filter(record(lost, "a", 8))


def test_another_subject_or_level_is_another_line_and_debug_is_never_collapsed() -> None:
    repeats = RepeatedLineFilter(clock=Clock())
    lost = "stream=%s lost its publisher"
    assert repeats.filter(record(lost, "a"))
    assert repeats.filter(record(lost, "b"))
    assert repeats.filter(record(lost, "a", level=logging.ERROR))
    assert not repeats.filter(record(lost, "b"))
    assert all(repeats.filter(record("decision %s", "x", level=logging.DEBUG)) for _ in range(3))


def test_the_oldest_line_is_forgotten_past_the_key_limit() -> None:
    repeats = RepeatedLineFilter(max_keys=2, clock=Clock())
    for subject in ("a", "b", "c"):
        assert repeats.filter(record("x=%s", subject))
    assert repeats.filter(record("x=%s", "a"))  # forgotten, so it passes again
    assert not repeats.filter(record("x=%s", "c"))


def test_every_command_logs_through_the_filter() -> None:
    """A real process configured as every command is: 200 identical warnings, one line."""
    script = (
        "import logging\n"
        "from conductor.runtime import configure_logging\n"
        "configure_logging('INFO')\n"
        "for seq in range(200):\n"
        "    logging.getLogger('conductor.x').warning('stream=%s gap at %d', 'a', seq)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    assert result.stderr.count("stream=a gap at") == 1, result.stderr
