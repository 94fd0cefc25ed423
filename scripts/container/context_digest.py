"""A digest of what `docker build .` sees in a directory: the Dockerfile, .dockerignore and
every file .dockerignore lets into the build context, by path and content.

build-image.sh labels the image with it (mooncake.context); the tests that run the image
(tests/container/) skip, saying so, when the image's label is not the work tree's digest: an
image built from another tree would test other code. In a git work tree only the files git
tracks count (a colleague's untracked file in the tree does not make the image stale).
    usage: python3 scripts/container/context_digest.py [DIR]
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ALWAYS = ("Dockerfile", ".dockerignore")


def _rules(root: Path) -> list[tuple[bool, str]]:
    path = root / ".dockerignore"
    lines = path.read_text().splitlines() if path.exists() else []
    rules = []
    for line in lines:
        pattern = line.strip()
        if pattern and not pattern.startswith("#"):
            rules.append((pattern.startswith("!"), pattern.removeprefix("!")))
    return rules


def in_context(path: str, rules: list[tuple[bool, str]]) -> bool:
    """Docker's rule: the last pattern that matches decides, ``!`` letting in; a pattern
    also covers what lies below a matched directory (as tests/test_image.py reads it)."""
    included = True
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for allow, pattern in rules:
        bare = pattern.removeprefix("**/")
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes) or (
            pattern.startswith("**/") and any(fnmatch.fnmatchcase(part, bare) for part in parts)
        ):
            included = allow
    return included


def _files(root: Path) -> list[str]:
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z"], capture_output=True, timeout=30
    )
    if listed.returncode == 0 and (root / ".git").exists():
        return [p for p in listed.stdout.decode().split("\0") if p]
    return [
        str(Path(folder, name).relative_to(root))
        for folder, _, names in os.walk(root)
        for name in names
    ]


def digest(root: Path) -> str:
    rules = _rules(root)
    total = hashlib.sha256()
    for path in sorted(set(_files(root))):
        full = root / path
        if not full.is_file() or not (path in ALWAYS or in_context(path, rules)):
            continue
        total.update(path.encode() + b"\0" + hashlib.sha256(full.read_bytes()).digest())
    return total.hexdigest()[:20]


if __name__ == "__main__":
    print(digest(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()))
