"""The repository's documents point only inside it, and every link of theirs resolves."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Documents that live outside the repository: a reader of a clone has none of them.
OUTSIDE = re.compile(r"(?<![\w/])DESIGN\.md|\.\./shared\b|shared/resear[c]h|STYLE\.md")
# [text](target) in Markdown, skipping URLs, mail links and in-page anchors.
LINK = re.compile(r"\[[^\]]*\]\((?!https?:|mailto:|#)([^)\s]+)\)")


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    return [ROOT / name.decode() for name in listed if name]


def test_no_file_cites_a_document_outside_the_repository() -> None:
    offenders = []
    for path in tracked_files():
        if path.suffix in {".png", ".ico", ".woff2"} or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_every_relative_link_in_the_documents_resolves() -> None:
    broken = []
    for path in tracked_files():
        if path.suffix != ".md":
            continue
        for target in LINK.findall(path.read_text()):
            file = target.split("#", 1)[0]
            if file and not (path.parent / file).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []


# A document named by its path, in code or in another document (a folder, then a .md name).
CITED = re.compile(r"(?<![\w./:-])((?:[\w.-]+/)+[\w.-]+\.md)\b")


def test_every_document_a_source_file_cites_by_path_is_in_the_repository() -> None:
    files = tracked_files()
    names = {path.relative_to(ROOT).as_posix() for path in files}
    missing = []
    for path in files:
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".tmpl"} or not path.is_file():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for cited in CITED.findall(line):
                relative = cited.removeprefix("./")
                if (path.parent / relative).exists() or any(
                    name == relative or name.endswith("/" + relative) for name in names
                ):
                    continue
                missing.append(f"{path.relative_to(ROOT)}:{number}: {cited}")
    assert missing == []
