"""gpusnap gpus"""

from __future__ import annotations

import click
from rich.table import Table

from gpusnap.cli.output import console, emit, handle_errors, human_bytes, json_option
from gpusnap.gpu.inventory import read_inventory


def _human(r: dict) -> None:
    if r["error"]:
        console.print(f"No usable NVIDIA GPU: {r['error']}")
        return
    table = Table(title=f"driver {r['driver_version']}, CUDA {r['cuda_driver_version']}")
    for col in ("index", "name", "uuid", "device", "bus", "cc", "memory used / total"):
        table.add_column(col)
    for g in r["gpus"]:
        table.add_row(str(g["index"]), g["name"], g["uuid"], f"/dev/nvidia{g['minor']}",
                      g["pci_bus_id"], g["compute_capability"],
                      f"{human_bytes(g['memory_used'])} / {human_bytes(g['memory_total'])}"
                      + (" MIG" if g["mig_enabled"] else ""))
    console.print(table)


@click.command("gpus")
@json_option
@handle_errors(root=False)
def gpus_cmd(as_json: bool) -> None:
    """List this host's NVIDIA GPUs (UUID, device node, memory, compute capability)."""
    emit(as_json, read_inventory().to_dict(), _human)


COMMANDS = [gpus_cmd]
