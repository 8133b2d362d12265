"""gpusnap checkpoint"""

from __future__ import annotations

import sys

import click

from gpusnap.cli.output import (console, emit, gpu_back_note, handle_errors, human_bytes,
                                json_option, step)
from gpusnap.gpu.quiesce import DEFAULT_LOCK_TIMEOUT_MS
from gpusnap.ops import advice, gpu_back
from gpusnap.ops.container_busy import only_command, refuse_if_busy
from gpusnap.ops import checkpoint as ops


def _human(r: dict) -> None:
    name = r["container"]["name"]
    # a container left running must stop before its checkpoint can come back
    back = f"`podman stop {name}`, then " if r["leave_running"] else ""
    where = r["export"] or f"Podman's storage ({back}`gpusnap restore {name}` brings it back)"
    console.print(f"[bold green]Checkpointed[/] {name} in {r['seconds']:.2f} s "
                  f"-> {where}")
    crit = r["criu"]
    console.print(f"  processes: {crit['processes']}, memory: {human_bytes(crit['memory_pages_bytes'])}"
                  + (f", archive: {human_bytes(r['export_bytes'])}" if r["export_bytes"] else ""))
    gpu = r["gpu"]
    if gpu:
        names = ", ".join(f"{g['index']}:{g['name']}" for g in gpu["gpus"]) or "-"
        console.print(f"  GPUs: {names}; GPU memory saved: {human_bytes(gpu['gpu_memory_bytes'])} "
                      f"(quiesced by {gpu['quiesced_by']}, {gpu['timing']})")
    if r["leave_running"]:
        console.print("  the container keeps running" + _on_gpus(r))
    if retaken := advice.retaken(r):
        console.print(f"  {retaken}")
    gpu_back_note(r)


def _on_gpus(r: dict) -> str:
    """Its GPUs given back by the guardian, where a leave-running dump took them."""
    if r.get("gpu_back") is False:
        return ", off its GPUs"
    if r.get("gpu_back") is not True:
        return ""
    return f", on its GPUs again {r['gpu_back_seconds']:.2f} s after Podman was done"


@click.command("checkpoint")
@click.argument("container")
@click.option("-e", "--export", metavar="FILE", help="Write the checkpoint to FILE (tar.zst), "
              "as `podman container checkpoint --export` does.")
@click.option("-R", "--leave-running", is_flag=True, help="Keep the container running afterwards.")
@click.option("--tcp-established", is_flag=True, help="Checkpoint established TCP connections.")
@click.option("--lock-timeout", "lock_timeout_ms", default=DEFAULT_LOCK_TIMEOUT_MS,
              show_default=True, help="Milliseconds to wait for running GPU work to finish "
              "before giving up (the container keeps running).")
@click.option("--skip-space-check", is_flag=True, help="Do not refuse when free disk space looks "
              "smaller than the container's memory.")
@json_option
@handle_errors
def checkpoint_cmd(container: str, export: str | None, leave_running: bool,
                   tcp_established: bool, lock_timeout_ms: int, skip_space_check: bool,
                   as_json: bool) -> None:
    """Checkpoint a running CONTAINER, its GPU memory included."""
    refuse_if_busy(container)  # before Podman is asked: it would wait on the other's dump
    plan = ops.plan(container, export, leave_running, tcp_established, lock_timeout_ms,
                    skip_space_check)
    with only_command(plan.container.id, plan.container.name, "gpusnap checkpoint"):
        result, interrupted = _checkpoint(plan, as_json)
    emit(as_json, result, _human)
    if interrupted:
        sys.exit(130)
    if result.get("gpu_back") is False:  # the checkpoint is kept; the container is off its GPUs
        sys.exit(1)


def _checkpoint(plan: ops.CheckpointPlan, as_json: bool) -> tuple[dict, bool]:
    """The dump, then (a CUDA container left running) its GPUs' give-back;
    whether Ctrl-C cut that wait."""
    what = f"{len(plan.cuda)} CUDA process(es)" if plan.cuda else "no GPU"
    with step(f"Checkpointing {plan.container.name} ({what}, up to "
              f"{human_bytes(plan.estimate_bytes)})...", as_json):
        result = ops.run(plan)
    # Podman is done before the guardian has given the GPUs back
    if not gpu_back.expected(plan.leave_running, bool(plan.cuda), plan.container.runtime):
        return result, False
    try:
        with step(f"Giving {plan.container.name} its GPUs back...", as_json):
            back, interrupted = gpu_back.wait(plan.container.pid, plan.container.name,
                                              *plan.dumped), False
    except KeyboardInterrupt:  # the checkpoint is done: said, not hidden behind Ctrl-C
        back, interrupted = gpu_back.not_waited(plan.container.name), True
    result.update(back.fields())
    return result, interrupted


COMMANDS = [checkpoint_cmd]
