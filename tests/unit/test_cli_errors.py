"""What reaches the user when a command fails: one line and what to do next,
never a traceback, and on --json a JSON object (cli/output.py)."""

from __future__ import annotations

import errno
import json

import click
import pytest
from click.testing import CliRunner

from gpusnap.cli.output import handle_errors
from gpusnap.errors import GpusnapError


def _command(raises: BaseException):
    @click.command()
    @click.option("--json", "as_json", is_flag=True)
    @handle_errors(root=False)
    def cmd(as_json: bool) -> None:
        raise raises
    return cmd


def _run(raises: BaseException, *args: str):
    return CliRunner().invoke(_command(raises), list(args))


def test_a_name_with_brackets_is_said_as_it_is_not_read_as_markup():
    res = _run(GpusnapError("no such file: /tmp/a[/x].tar and [red]b.tar", "check [/dim]it"))
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "no such file: /tmp/a[/x].tar and [red]b.tar" in res.output
    assert "check [/dim]it" in res.output


def test_an_oserror_no_step_worded_is_one_line_with_what_to_do():
    res = _run(OSError(errno.ENOSPC, "No space left on device", "/var/tmp/x.partial"))
    assert res.exit_code == 1
    assert "No space left on device: /var/tmp/x.partial" in res.output
    assert "free space on that filesystem" in res.output
    res = _run(PermissionError(errno.EACCES, "Permission denied", "/sys/x.tar"), "--json")
    said = json.loads(res.output)
    assert said["error"] == "Permission denied: /sys/x.tar" and "permissions" in said["hint"]


def test_a_bug_is_one_line_that_says_so_and_the_traceback_is_there_on_ask(monkeypatch):
    res = _run(KeyError("processes"), "--json")
    assert res.exit_code == 70
    said = json.loads(res.output)
    assert said["error"] == "internal error: KeyError: 'processes'"
    assert "GPUSNAP_DEBUG=1" in said["hint"]
    monkeypatch.setenv("GPUSNAP_DEBUG", "1")
    res = _run(KeyError("processes"))
    assert isinstance(res.exception, KeyError)


def test_ctrl_c_and_click_s_own_exits_are_not_taken_for_a_bug():
    res = _run(KeyboardInterrupt())
    assert res.exit_code == 130 and "Interrupted" in res.output
    assert _run(click.exceptions.Exit(3)).exit_code == 3  # ctx.exit(3) in a command
    # a pipe of gpusnap's own (stdout is not a pipe here): one line, as any OSError
    res = _run(BrokenPipeError(errno.EPIPE, "Broken pipe"))
    assert res.exit_code == 1 and "Error: Broken pipe" in res.output


def test_stdout_that_nobody_reads_is_told_apart(monkeypatch):
    import os
    import sys

    from gpusnap.cli import output

    r, w = os.pipe()
    with os.fdopen(w, "w") as writer:
        monkeypatch.setattr(sys, "stdout", writer)
        assert not output._stdout_closed()
        os.close(r)  # `| head -1` done: click's quiet end is right for it
        assert output._stdout_closed()


def test_a_library_s_oserror_is_not_taken_for_a_path():
    requests = pytest.importorskip("requests")
    res = _run(requests.exceptions.InvalidURL("Invalid URL 'http://x:99999'"), "--json")
    assert res.exit_code == 70 and json.loads(res.output)["error"].startswith("internal error")


def test_ctrl_c_with_json_is_a_json_object():
    res = _run(KeyboardInterrupt(), "--json")
    assert res.exit_code == 130
    assert json.loads(res.output) == {"error": "interrupted (Ctrl-C)",
                                      "hint": "`gpusnap doctor` checks for anything left half done"}


def test_a_bad_option_value_with_json_is_a_json_object(monkeypatch, capsys):
    from gpusnap.cli import main as cli_main

    argv = ["gpusnap", "push", "/tmp/x", "127.0.0.1:5/a/b:c", "--compression-level", "0", "--json"]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as done:
        cli_main.main()
    assert done.value.code == 2  # click's code for a usage error, as before
    said = json.loads(capsys.readouterr().out)
    assert "'--compression-level': 0 is not in the range" in said["error"]
    assert said["hint"] == "`gpusnap push --help` lists what it takes"
    monkeypatch.setattr("sys.argv", argv[:-1])  # without --json: click's own words
    with pytest.raises(SystemExit):
        cli_main.main()
    assert "Try 'gpusnap push --help' for help." in capsys.readouterr().err


def test_bad_registry_flags_say_what_to_do(tmp_path):
    from gpusnap.oci import auth
    from gpusnap.oci.registry_options import RegistryOptions, tls_verify

    with pytest.raises(GpusnapError) as err:
        tls_verify("reg.io", RegistryOptions(ca_file=str(tmp_path / "nope.pem")))
    assert err.value.hint.startswith("pass the path of the CA certificate")
    with pytest.raises(GpusnapError) as err:
        auth.find_credentials("reg.io", "a/b", authfile=str(tmp_path / "nope.json"))
    assert "--authfile" in err.value.hint


def _interrupted_then(raises: GpusnapError, *args: str):
    # Ctrl-C noted by the handler, then the error the interrupted step built
    import os
    import signal

    @click.command()
    @click.option("--json", "as_json", is_flag=True)
    @handle_errors(root=False)
    def cmd(as_json: bool) -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            pass
        raise raises
    return CliRunner().invoke(cmd, list(args))


def test_the_line_built_for_a_ctrl_c_says_where_the_checkpoint_is_kept():
    kept = GpusnapError("interrupted; web is checkpointed and stopped, its checkpoint is kept in "
                        "/var/tmp/x/checkpoint.tar", "`gpusnap push /var/tmp/x/checkpoint.tar r/x:1` "
                        "tries again", exit_code=130)
    res = _interrupted_then(kept, "--json")
    assert res.exit_code == 130
    assert json.loads(res.output)["error"].startswith("interrupted; web is checkpointed and stopped")
    # a child's failure of the same Ctrl-C is the user's interrupt, not Podman's failure
    res = _interrupted_then(GpusnapError("podman failed: signal: interrupt"))
    assert res.exit_code == 130 and "Interrupted (Ctrl-C)" in res.output
    assert "podman failed" not in res.output
