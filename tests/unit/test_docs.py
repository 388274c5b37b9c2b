"""README.md and docs/*.md quote commands a reader will paste: each must exist. Checked against the repository's
own files, never against the docs: a `make` target against the Makefile's rules, `python -m eagle_lib.X` against
the package's modules, a script or benchmark path against the file tree, each `--flag` quoted after a benchmark, a
script or a module against that file's source (an argparse option is spelled there in quotes, a shell option as a
`case` arm), a link to a local file against the tree. README.md stays a front page (issue 43: at most ~200 lines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a command is a line of a fenced block or an inline `code` span; `\` continuations are joined
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
INLINE = re.compile(r"`([^`\n]+)`")


def commands(text: str) -> list[str]:
    out = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        out += [ln.split("#")[0].strip() for ln in joined.splitlines() if ln.strip()]
    out += [m.strip() for m in INLINE.findall(FENCE.sub("", text))]
    return out


def make_targets() -> set[str]:
    rules = re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M)
    return set(rules)


def module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__main__.py", base / "__init__.py"):
        if p.is_file():
            return p
    return None


def problems(doc: Path) -> list[str]:
    bad, targets = [], make_targets()
    for cmd in commands(doc.read_text()):
        words = cmd.split()
        for i, w in enumerate(words):
            if w == "make" and i + 1 < len(words) and re.fullmatch(r"[a-z][a-z0-9_-]*", words[i + 1]):
                if words[i + 1] not in targets:
                    bad.append(f"{doc.name}: `{cmd}`: no make target {words[i + 1]!r}")
        src = None
        m = re.search(r"python[0-9.]* -m (eagle_lib[\w.]*)", cmd)
        if m:
            src = module_file(m.group(1))
            if src is None:
                bad.append(f"{doc.name}: `{cmd}`: no module {m.group(1)}")
        m = re.search(r"(?:^|\s|/)((?:benchmarks|scripts)/[\w./-]+\.(?:py|sh))", cmd)
        if m:
            src = ROOT / m.group(1)
            if not src.is_file():
                bad.append(f"{doc.name}: `{cmd}`: no file {m.group(1)}")
                src = None
        if src is not None:
            text = src.read_text()
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", cmd):
                quoted = f'"{flag}"' in text or f"'{flag}'" in text
                if not quoted and not (src.suffix == ".sh" and f"{flag})" in text):  # a shell `case` arm
                    bad.append(f"{doc.name}: `{cmd}`: {src.relative_to(ROOT)} has no option {flag}")
    for link in re.findall(r"\]\(((?!https?:)[^)#\s]+)", doc.read_text()):
        if not (doc.parent / link).exists():
            bad.append(f"{doc.name}: link to {link}: no such file")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_quoted_command_exists(doc):
    assert problems(doc) == []


def test_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_check_sees_a_missing_target_module_file_and_flag(tmp_path, monkeypatch):
    doc = tmp_path / "X.md"
    doc.write_text(
        "```bash\nmake run\nmake no-such-target\npython -m eagle_lib.no_such_module\n"
        "python benchmarks/no_such.py\n.venv/bin/python benchmarks/bench_threads.py --threads 1 --no-such-flag\n```\n"
        "See [a](missing.md) and `python -m eagle_lib.pipeline run x.yaml --stages 03`.\n"
    )
    found = problems(doc)
    assert any("no make target 'no-such-target'" in p for p in found)
    assert any("no module eagle_lib.no_such_module" in p for p in found)
    assert any("no file benchmarks/no_such.py" in p for p in found)
    assert any("has no option --no-such-flag" in p for p in found)
    assert any("link to missing.md" in p for p in found)
    ok = ("has no option --threads", "no make target 'run'", "has no option --stages", "eagle_lib.pipeline`")
    assert not any(o in p for o in ok for p in found), found
