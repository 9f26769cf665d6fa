"""The README and docs/ hold together: the quick start's commands are ./dev's, every relative link
(and its #anchor) resolves, every `ckpt` command named exists, and the repository ignores what a
quick start writes."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pipeline.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|\!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.M)}


def section(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {name}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc: Path):
    bad = []
    for m in LINK.finditer(doc.read_text()):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target}: no {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{doc.name}: {bad}"


def test_the_quick_start_is_two_dev_commands_that_dev_runs():
    block = re.search(r"```sh\n(.*?)```", section("Quick start"), re.S).group(1)
    commands = [line.split("#")[0].split() for line in block.splitlines() if line.strip()]
    assert commands == [["./dev", "up"], ["./dev", "test"]]
    script = (ROOT / "dev").read_text()
    up = r"^\s+up\)\n\s+install postgres\n(\s+compiled [\w ]+\n)?\s+exec \"\$VENV/bin/ckpt\" up"
    assert re.search(up, script, re.M)
    assert re.search(r"^\s+test\)\n\s+install test\n", script, re.M)
    assert subprocess.run(["bash", "-n", str(ROOT / "dev")]).returncode == 0
    usage = subprocess.run([str(ROOT / "dev"), "help"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "./dev up" in usage.stderr and "./dev test" in usage.stderr


def test_every_ckpt_command_the_readme_names_exists():
    commands = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    named = set(re.findall(r"`ckpt ([a-z][a-z-]+)", (ROOT / "README.md").read_text()))
    assert {"status", "workers", "restore", "scrub", "gc"} <= named
    assert named <= commands, named - commands


def test_the_install_line_keeps_the_installed_torch():
    install = section("Installing into a training environment")
    assert "pip install -c keep-torch.txt" in install and "torch.__version__" in install
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in install
    pyproject = (ROOT / "pyproject.toml").read_text()
    for req in re.findall(r'"torch([^"]*)"', pyproject):  # a lower bound that torch 2.13 meets
        assert re.fullmatch(r">=2\.\d+", req) and int(req.split(".")[1]) <= 13, req


def test_git_ignores_what_a_quick_start_writes():
    for path in ("checkpoints/step_100.safetensors", "runs/a/checkpoint-1", ".ckpt/ckpt.db"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert r.returncode == 0, f"{path} is not ignored"


def test_dev_test_runs_where_it_cannot_write_bytecode(tmp_path):
    """Given a checkout where ./dev's bytecode step cannot write (a read-only tree, a bind mount, a
    ``__pycache__`` that is not a directory: here the last, which root cannot write through
    either), When ``./dev test`` runs, Then pytest still runs: bytecode only saves each process
    compiling our modules (it reads the sources either way), so it never stops the command."""
    import os
    import shutil
    import sys

    tree = tmp_path / "checkout"
    tree.mkdir()
    for name in ("dev", "pyproject.toml"):
        shutil.copy2(ROOT / name, tree / name)
    for package in ("pipeline", "migrations", "webui", "workers", "tests", "bench"):
        (tree / package).mkdir()
        (tree / package / "__init__.py").write_text("")
    (tree / "pipeline" / "__pycache__").write_text("not a directory")
    venv = tree / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / ".installed-test").touch()  # installed: ./dev skips pip
    (venv / "bin" / "chromium").write_text("#!/bin/sh\n")  # found: ./dev installs no browser
    (venv / "bin" / "chromium").chmod(0o755)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    env.pop("CKPT_VENV", None)
    r = subprocess.run([str(tree / "dev"), "test", "--version"], cwd=tree, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "pytest" in r.stdout + r.stderr, (r.returncode, r.stdout, r.stderr)
