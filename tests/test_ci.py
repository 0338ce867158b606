"""CI can fail: every step of `.ci/run` stops it, the slow loop runs, and a broken docs link fails the docs step.

`.ci/run` is run on a copy of itself whose steps are stand-ins (install.sh, ruff, mkdocs, python) that log their
arguments and exit with a chosen status, so each step's failure is checked without installing anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("install", "ruff", "mkdocs", "python")


def _stand_in(path: Path, name: str, log: Path, fail: str | None) -> None:
    status = 3 if name == fail else 0
    path.write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> "{log}"\nexit {status}\n')
    path.chmod(0o755)


def _ci_copy(tmp_path: Path, fail: str | None) -> tuple[Path, Path]:
    (tmp_path / ".ci").mkdir()
    for script in ("run", "docs"):
        shutil.copy(ROOT / ".ci" / script, tmp_path / ".ci" / script)
    log = tmp_path / "steps.log"
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    _stand_in(tmp_path / "install.sh", "install", log, fail)
    for name in ("ruff", "mkdocs", "python"):
        _stand_in(bin_dir / name, name, log, fail)
    return tmp_path / ".ci" / "run", log


def _run(script: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in {"RAG_CACHE", "MKDOCS"}}
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)


def test_ci_runs_every_step_and_both_test_loops(tmp_path):
    script, log = _ci_copy(tmp_path, fail=None)
    proc = _run(script)
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["install", "ruff", "mkdocs", "python", "python"]
    assert lines[0] == "install dev"
    assert lines[3].endswith("-m pytest -q")
    assert lines[4].endswith("-m pytest -q -m slow")


@pytest.mark.parametrize("fail", STEPS)
def test_a_failed_step_fails_ci_and_stops_it(tmp_path, fail):
    script, log = _ci_copy(tmp_path, fail=fail)
    proc = _run(script)
    assert proc.returncode != 0
    ran = [line.split()[0] for line in log.read_text().splitlines()]
    assert ran[-1] == fail, f"steps after the failed {fail} still ran: {ran}"
    assert ran.count(fail) == 1


def _docs_copy(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


@pytest.fixture(scope="module")
def mkdocs() -> str:
    exe = ROOT / ".venv" / "bin" / "mkdocs"
    found = str(exe) if exe.exists() else shutil.which("mkdocs")
    if not found:
        pytest.skip("mkdocs is not installed (bash install.sh dev installs it)")
    return found


def _docs(project: Path, mkdocs: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MKDOCS": mkdocs}
    return subprocess.run(["bash", str(ROOT / ".ci" / "docs"), str(project)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_the_docs_build_with_no_warning(tmp_path, mkdocs):
    proc = _docs(_docs_copy(tmp_path), mkdocs)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("link", ["[gone](no-such-page.md)", "![plot](../benchmarks/results/outside.png)",
                                  "[anchor](training.md#no-such-heading)"])
def test_a_broken_link_fails_the_docs_step(tmp_path, mkdocs, link):
    project = _docs_copy(tmp_path)
    page = project / "docs" / "index.md"
    page.write_text(page.read_text() + f"\n\nSee {link}.\n")
    proc = _docs(project, mkdocs)
    assert proc.returncode != 0
    assert "WARNING" in proc.stdout, proc.stdout + proc.stderr
