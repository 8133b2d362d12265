"""gpusnap.cli.main imports a command's module only when the command runs:
its table of commands must name every command each module defines, and no other."""

from __future__ import annotations

import importlib
import subprocess
import sys

from click.testing import CliRunner

from gpusnap.cli import main


def test_every_command_is_in_the_table_with_its_module():
    defined = {}
    for module in set(main.VERBS.values()):
        for command in importlib.import_module(f"gpusnap.cli.{module}").COMMANDS:
            defined[command.name] = module
    assert defined == main.VERBS


def test_help_lists_every_command_and_an_unknown_one_is_refused():
    runner = CliRunner()
    listed = runner.invoke(main.cli, ["--help"])
    assert listed.exit_code == 0
    for name in main.VERBS:
        assert f"  {name} " in listed.output
    wrong = runner.invoke(main.cli, ["restroe"])
    assert wrong.exit_code == 2 and "No such command 'restroe'" in wrong.output


def test_one_command_loads_its_own_module_only():
    probe = ("import sys; from gpusnap.cli.main import cli\n"
             "try:\n    cli(['restore', '--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m.startswith('gpusnap.cli.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    loaded = out.strip().splitlines()[-1]
    assert "gpusnap.cli.restore" in loaded
    for other in ("checkpoint", "doctor", "move", "key", "status", "gpus"):
        assert f"gpusnap.cli.{other}'" not in loaded
