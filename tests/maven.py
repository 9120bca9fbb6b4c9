"""Java servers for the tests from Maven Central: a pom's classpath, resolved once and cached.

A server's ``pom.xml`` (``tests/kafka/pom.xml``, ``tests/sqs/pom.xml``) names
its artifacts; Maven resolves them on the first run and the classpath is
cached under the user's cache directory, keyed by the pom's hash, so later
runs start the JVM without asking Maven anything.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nemesis-tests"


def maven_classpath(pom: Path, name: str, what: str) -> str:
    """The classpath of ``pom``'s dependencies, resolved by Maven once and cached.

    ``name`` names the cache file, ``what`` the server in a failure. Fails
    the test with Maven's own error lines when it cannot resolve. xdist
    workers take a lock: one resolves, the others read what it cached.
    """
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:16]
    cached = cache_dir() / f"{name}-classpath-{digest}.txt"
    cached.parent.mkdir(parents=True, exist_ok=True)
    with (cached.parent / f"{name}-classpath.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached.is_file():
            classpath = cached.read_text().strip()
            if classpath and all(Path(jar).is_file() for jar in classpath.split(os.pathsep)):
                return classpath
        _resolve(pom, what, cached)
    return cached.read_text().strip()


def _resolve(pom: Path, what: str, into: Path) -> None:
    for tool in ("mvn", "java"):
        if shutil.which(tool) is None:
            pytest.fail(
                f"`{tool}` is not on PATH: the tests of {what} need Maven and a JDK >= 17"
                " (`make system-packages` installs them)",
                pytrace=False,
            )
    partial = into.with_suffix(f".{os.getpid()}.part")
    result = subprocess.run(
        [
            "mvn",
            "-B",
            "-q",
            "-Dstyle.color=never",
            "-f",
            str(pom),
            "dependency:build-classpath",
            f"-Dmdep.outputFile={partial}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0 or not partial.is_file():
        output = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr).splitlines()
        # Maven's error, without the advice it prints after it.
        errors = [line for line in output if line.startswith("[ERROR]")][:1] or output[-20:]
        pytest.fail(
            f"Maven could not resolve {what} from {pom} (exit {result.returncode}):\n"
            + "\n".join(errors),
            pytrace=False,
        )
    os.replace(partial, into)
