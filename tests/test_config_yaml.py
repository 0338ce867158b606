"""The YAML a user gives `rag fit | validate | test | predict` is bounded before any loader expands it: aliases may add
at most MAX_ALIAS_NODES nodes, nesting at most MAX_YAML_DEPTH levels, and every YAML the command line can make the
parser read is checked (--config files, files named as values or inside configs, inline values)."""

from __future__ import annotations

import pytest

from rag.cli import main
from rag.utils.errors import ConfigError
from rag.utils.yaml_files import MAX_ALIAS_NODES, check_cli_yaml, check_yaml_text


def bomb(levels: int, width: int = 9) -> str:
    """The billion-laughs shape: level k is a list of `width` aliases of level k-1 (width**levels nodes expanded)."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * width)}]" for k in range(1, levels)]
    return "\n".join(lines) + "\n"


def last_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and lines, err
    return lines[-1]


@pytest.mark.parametrize("levels", [5, 9])  # 59,049 and 387,420,489 nodes once expanded
def test_an_alias_bomb_in_a_config_is_refused_naming_the_file(tmp_path, capsys, levels):
    config = tmp_path / "bomb.yaml"
    config.write_text(bomb(levels))
    assert main(["fit", "--config", str(config)]) == 2
    line = last_line(capsys.readouterr().err)
    assert str(config) in line and f"expand to more than {MAX_ALIAS_NODES:,} nodes" in line


def test_the_help_path_and_the_python_entry_are_checked_too(tmp_path, capsys):
    """`rag fit --config X --model.rag.help` reads the config's class_path itself, and make_cli is the Python entry."""
    from rag.cli.train import make_cli

    config = tmp_path / "bomb.yaml"
    config.write_text(bomb(6))
    assert main(["fit", "--config", str(config), "--model.rag.help"]) == 2
    assert str(config) in last_line(capsys.readouterr().err)
    with pytest.raises(ConfigError, match="expand to more than"):
        make_cli(["--config", str(config)], run=False)


def test_yaml_that_a_config_or_an_option_names_is_checked(tmp_path):
    inner = tmp_path / "model.yaml"
    inner.write_text(bomb(6))
    outer = tmp_path / "outer.yaml"
    outer.write_text("model: model.yaml\n")  # relative to the config's folder, as jsonargparse resolves it
    with pytest.raises(ConfigError, match=f"{inner}: its YAML aliases"):
        check_cli_yaml(["--config", str(outer)])
    with pytest.raises(ConfigError, match=f"{inner}: its YAML aliases"):
        check_cli_yaml([f"--model={inner}"])
    with pytest.raises(ConfigError, match="the value of --model: its YAML aliases"):
        check_cli_yaml(["--model", "{" + bomb(6).replace("\n", ", ").rstrip(", ") + "}"])
    looped = tmp_path / "a.yaml"
    looped.write_text("model: a.yaml\n")  # a config naming itself is read once
    check_cli_yaml(["--config", str(looped)])


def test_modest_aliases_and_ordinary_configs_pass():
    check_yaml_text(bomb(3), "x.yaml")  # 9 + 81 nodes added
    check_yaml_text("base: &b {lr: 0.1, steps: 3}\nfirst: *b\nsecond: *b\n", "x.yaml")
    check_yaml_text("\n".join(f"k{i}: {i}" for i in range(50_000)), "x.yaml")  # large without aliases
    check_yaml_text("a: [unclosed\n", "x.yaml")  # not YAML: the loader reports it in its own words
    with pytest.raises(ConfigError, match="nests more than 64 levels"):
        check_yaml_text("[" * 100 + "]" * 100, "deep.yaml")


def test_a_device_as_a_config_is_refused(capsys):
    assert main(["fit", "--config", "/dev/zero"]) == 2
    line = last_line(capsys.readouterr().err)
    assert "/dev/zero" in line and "character device" in line
