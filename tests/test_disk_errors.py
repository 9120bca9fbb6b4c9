"""A full disk and a read-only data directory, for real: errors name the file and the cause.

The disk is a small tmpfs mounted for the test (root can mount one, as in CI);
the read-only directory is the same tmpfs remounted read-only. Where mounting is
not allowed, those tests say so and skip; tests/test_embedded_db.py still
fills a real SQLite file to its page limit.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Workspace


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB file system of its own."""
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    try:
        mounted = _mount("-t", "tmpfs", "-o", "size=512k,mode=0777", "tmpfs", str(mountpoint))
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def fill(path: Path) -> None:
    """Writes ``path`` until the disk refuses (ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 65536):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC  # noqa: PT017 - the disk is full, nothing else
    finally:
        os.close(fd)


def workspace_on(disk: Path) -> Workspace:
    space = Workspace(disk)
    space.write_config()
    return space


def test_publish_on_a_full_disk_says_so_and_how_many_it_wrote(small_disk: Path) -> None:
    workspace = workspace_on(small_disk)
    created = workspace.cli("topics", "create", "orders", "--partitions", "1")
    assert created.returncode == 0, created.stderr
    messages = small_disk.parent / "orders.jsonl"  # off the small disk
    messages.write_text("".join(f'{{"id": {n}, "pad": "{"x" * 400}"}}\n' for n in range(5000)))

    published = workspace.cli(
        "publish", "orders", "--file", str(messages), "--lines", "--batch", "50"
    )
    assert published.returncode == 1
    assert "Traceback" not in published.stderr
    assert f"{workspace.db_path}: the disk is full" in published.stderr, published.stderr
    assert "disk I/O error" not in published.stderr
    said = published.stderr.split("failed after writing ", 1)[1]
    written = int(said.split(" ", 1)[0])
    assert 0 < written < 5000
    assert f"the input from message {written + 1} on was not written" in published.stderr

    # What it says it wrote is what the topic holds.
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    described = workspace.cli("topics", "describe", "orders", "--json")
    assert described.returncode == 0, described.stderr
    assert '"end_offset": ' + str(written) in described.stdout


def test_a_read_only_data_directory_names_the_file_and_the_cause(small_disk: Path) -> None:
    workspace = workspace_on(small_disk)
    remounted = _mount("-o", "remount,ro", str(small_disk))
    assert remounted.returncode == 0, remounted.stderr
    listed = workspace.cli("topics", "list")
    assert listed.returncode == 1
    assert "Traceback" not in listed.stderr
    assert f"{workspace.db_path}: the file system holding {small_disk} is mounted read-only" in (
        listed.stderr
    )


def test_a_data_directory_that_cannot_be_created_names_the_folder(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file where the data folder should be")
    workspace = Workspace(tmp_path)
    workspace.write_config()
    config = tmp_path / "nemesis.yaml"
    config.write_text(config.read_text().replace(str(workspace.db_path), "blocker/x/nemesis.db"))
    listed = workspace.cli("topics", "list")
    assert listed.returncode == 1
    assert "Traceback" not in listed.stderr
    assert "cannot create the folder" in listed.stderr
    assert "blocker/x" in listed.stderr


def test_an_io_error_on_a_full_disk_is_called_a_full_disk(small_disk: Path) -> None:
    """SQLite says "disk I/O error" when a write fails for want of space: name the real cause."""
    import sqlite3

    from nemesis.broker.embedded.db import translate

    fill(small_disk / "filler")
    error = sqlite3.OperationalError("disk I/O error")
    error.sqlite_errorcode = sqlite3.SQLITE_IOERR_WRITE
    message = str(translate(error, small_disk / "nemesis.db"))
    assert message.startswith(f"{small_disk / 'nemesis.db'}: the disk is full (")
    assert message.endswith("(sqlite: disk I/O error)")
