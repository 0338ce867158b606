"""`rag`'s command table: each command's module imports what it runs at its top, so `rag --help` imports none of them,
and a command whose optional dependency is missing says which one in one line."""

from __future__ import annotations

import argparse
import subprocess
import sys

from rag.cli import COMMANDS, build_parser


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a.help for a in sub._choices_actions}


def test_the_table_gives_each_command_the_help_its_own_parser_gives():
    assert _helps(build_parser()) == {name: help for name, (_, help) in COMMANDS.items()}
    assert _helps(build_parser("")) == _helps(build_parser())


def test_rag_help_imports_no_command_module_and_no_torch():
    code = ("import sys, rag.cli; rag.cli.build_parser(''); "
            "print(sorted(m for m in sys.modules if m.startswith('rag.cli.') or m in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_missing_optional_dependency_is_one_line_naming_the_extra():
    code = "import sys; sys.modules['fastapi'] = None; from rag.cli import main; sys.exit(main(['serve', '--help']))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "rag serve: error: it needs the package 'fastapi', which is not installed; " \
                               "pip install 'rag[serve]'"
