"""Every console script answers ``--version`` and ``--help``, and its help says what each
option does: a newcomer's first commands."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest

from conductor.runtime import package_version
from tests.support.processes import REPO

SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
SUBCOMMANDS = {"mooncake-fleet": [["up"]]}
HELP_INDENT = "  "  # argparse's indent of an argument's first line


def run_script(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The console script's entry point (``module:function``) as a real process."""
    module, function = SCRIPTS[script].split(":")
    code = f"import sys; sys.argv[0] = {script!r}; from {module} import {function}; {function}()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "100", "NO_COLOR": "1"},
    )


def undescribed(help_text: str) -> list[str]:
    """The arguments of argparse's help that have no description: an argument line is
    indented two spaces; its description follows after two spaces or on the next line."""
    lines = help_text.splitlines()
    sections = [i for i, line in enumerate(lines) if line.endswith(":") and line[:1].strip()]
    missing = []
    for index in range(sections[0] + 1 if sections else len(lines), len(lines)):
        line = lines[index]
        if not line.startswith(HELP_INDENT) or line[2:3] in (" ", ""):
            continue
        invocation, _, description = line.strip().partition("  ")
        following = lines[index + 1] if index + 1 < len(lines) else ""
        continued = following.startswith(HELP_INDENT + " ") and following.strip()
        if not description.strip() and not continued:
            missing.append(invocation)
    return missing


def test_the_help_parser_finds_an_undescribed_option() -> None:
    text = (
        "usage: x [-h]\n\ndescription\n\noptions:\n"
        "  -h, --help            show this help message and exit\n"
        "  --port PORT\n"
        "  --a-very-long-option-name A_VERY_LONG_OPTION_NAME\n"
        "                        described below\n"
        "  --host HOST\n"
    )
    assert undescribed(text) == ["--port PORT", "--host HOST"]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_script_has_version_and_described_help(script: str) -> None:
    version = run_script(script, "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"{script} {package_version()}"
    for command in [[], *SUBCOMMANDS.get(script, [])]:
        shown = run_script(script, *command, "--help")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"usage: {' '.join([script, *command])} ")
        assert undescribed(shown.stdout) == [], f"{script} {' '.join(command)}"
