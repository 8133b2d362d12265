"""A checkpoint or restore that fails in runc's shim names CRIU's log; the
error gpusnap prints carries CRIU's first error from it."""

from __future__ import annotations

from gpusnap.ops.containerd_api import with_criu_error


def test_criu_s_first_error_is_added_from_the_log_the_shim_names(tmp_path):
    log = tmp_path / "criu-dump.log"
    log.write_text("(00.000010) Version: 4.2.1\n"
                   "(00.120000) Error (criu/cr-dump.c:1890): Dumping FAILED.\n"
                   "(00.130000) Error (criu/cr-dump.c:2100): later fallout\n")
    details = f"criu failed: type DUMP errno 0 (CRIU log: {log})"
    assert with_criu_error(details) == \
        f"{details}; CRIU: Error (criu/cr-dump.c:1890): Dumping FAILED."


def test_without_a_readable_log_the_answer_stays_as_it_was(tmp_path):
    gone = f"criu failed: type RESTORE errno 0 (CRIU log: {tmp_path / 'gone.log'})"
    assert with_criu_error(gone) == gone
    assert with_criu_error("container rm3 not found") == "container rm3 not found"
