"""A plain-HTTP docker-registry for the fault tests and bench/migrate.py, on
loopback or inside a network namespace reached over a veth pair (pyroute2).

No TLS and no auth: the registry flags are tested in tests/integration; here
the faults are the point (a killed registry, a link that goes down).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path


def in_netns(name: str, argv: list[str]) -> list[str]:
    """ARGV run inside network namespace NAME by nsenter (util-linux), not by a
    setns in subprocess's preexec_fn: that is unsafe in a process with threads
    (pytest's, by then), where the child can deadlock before its exec: a
    registry that never started, with an empty log, once in CI133."""
    from pyroute2.netns import NETNS_RUN_DIR

    return ["nsenter", f"--net={NETNS_RUN_DIR}/{name}", "--", *argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PlainRegistry:
    root: Path
    addr: str
    port: int
    netns: str | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def host(self) -> str:
        return f"{self.addr}:{self.port}"

    def ref(self, name: str) -> str:
        return f"{self.host}/{name}"

    @staticmethod
    def flags() -> list[str]:
        return ["--plain-http"]

    def start(self) -> "PlainRegistry":
        log = open(self.root / "registry.log", "ab")
        argv = ["docker-registry", "serve", str(self.root / "config.yml")]
        self.proc = subprocess.Popen(in_netns(self.netns, argv) if self.netns else argv,
                                     stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 60  # a loaded CI host: 15 s ran out once (CI127)
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2)
                return self
            except urllib.error.HTTPError:
                return self
            except OSError:
                if self.proc.poll() is not None:
                    break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"docker-registry did not start: {(self.root / 'registry.log').read_text()}")

    def kill(self) -> None:
        """SIGKILL: a crash, storage kept."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def cpu_seconds(self) -> float:
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def linked_blobs(self, repository: str) -> set[str]:
        layers = self.root / "storage/docker/registry/v2/repositories" / repository / "_layers/sha256"
        return {f"sha256:{p.name}" for p in layers.glob("*") if (p / "link").is_file()} \
            if layers.is_dir() else set()


def make_registry(root: Path, addr: str = "127.0.0.1", port: int | None = None,
                  netns: str | None = None) -> PlainRegistry:
    """Started, storage under ``root``; inside ``netns`` when given."""
    if shutil.which("docker-registry") is None:
        raise RuntimeError("docker-registry is not installed (make deps)")
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    (root / "config.yml").write_text(f"""version: 0.1
log: {{level: warn, accesslog: {{disabled: true}}}}
storage:
  filesystem: {{rootdirectory: {root / 'storage'}}}
  delete: {{enabled: true}}
http:
  addr: {addr}:{port}
  secret: gpusnap-faults-{port}
""")
    return PlainRegistry(root, addr, port, netns).start()


@dataclass
class VethLink:
    """A network namespace (the "registry host") joined to this one by a veth pair:
    HOST_IP here on ``host_if``, PEER_IP inside the namespace on ``peer_if``."""
    netns: str
    host_if: str
    peer_if: str
    host_ip: str
    peer_ip: str

    def set_up(self, up: bool) -> None:
        """Bring the host's end up or down: the cable pulled, from this side.
        Down, the kernel drops the link's route and sends the registry's packets
        by the default one, whose gateway may answer them (a reset, "connection
        refused") or not, by host: here whatever goes to the registry host is
        dropped as well, so that a down link answers nothing on every host."""
        from pyroute2 import IPRoute

        if up:
            self._drop_rule("-D")
        with IPRoute() as ipr:
            idx = ipr.link_lookup(ifname=self.host_if)[0]
            ipr.link("set", index=idx, state="up" if up else "down")
        if not up:
            self._drop_rule("-I")

    def _drop_rule(self, op: str) -> None:
        """iptables' rule dropping what this host sends to the registry host:
        ``-I`` adds it, ``-D`` takes it away (absent: nothing to do)."""
        res = subprocess.run(["iptables", op, "OUTPUT", "-d", self.peer_ip, "-j", "DROP"],
                             capture_output=True, text=True, timeout=30)
        if res.returncode and op == "-I":
            raise RuntimeError(f"iptables {op}: {res.stderr.strip()}")

    def lose(self, percent: float) -> None:
        """Drop ``percent`` of the packets the registry host receives and of those
        it sends, at random (iptables' statistic match in its namespace): a
        lossy link, where a down one drops everything. Entered as the registry
        is (in_netns)."""
        for chain in ("INPUT", "OUTPUT"):
            subprocess.run(in_netns(self.netns, [
                "iptables", "-A", chain, "-m", "statistic", "--mode", "random",
                "--probability", f"{percent / 100:.4f}", "-j", "DROP"]), check=True, timeout=30)

    def remove(self) -> None:
        from pyroute2 import IPRoute, netns

        self._drop_rule("-D")
        with IPRoute() as ipr:
            found = ipr.link_lookup(ifname=self.host_if)
            if found:
                ipr.link("del", index=found[0])  # takes its peer with it
        if self.netns in netns.listnetns():
            netns.remove(self.netns)


def make_veth_link(subnet: int = 77) -> VethLink:
    """10.<subnet>.0.1/24 here, 10.<subnet>.0.2/24 in a new namespace, both up."""
    from pyroute2 import IPRoute, NetNS, netns

    tag = uuid.uuid4().hex[:6]
    link = VethLink(f"gpusnap-reg-{tag}", f"gsh-{tag}", f"gsp-{tag}",
                    f"10.{subnet}.0.1", f"10.{subnet}.0.2")
    netns.create(link.netns)
    try:
        with IPRoute() as ipr:
            ipr.link("add", ifname=link.host_if, kind="veth", peer=link.peer_if)
            host = ipr.link_lookup(ifname=link.host_if)[0]
            peer = ipr.link_lookup(ifname=link.peer_if)[0]
            ipr.link("set", index=peer, net_ns_fd=link.netns)
            ipr.addr("add", index=host, address=link.host_ip, prefixlen=24)
            ipr.link("set", index=host, state="up")
        with NetNS(link.netns) as ns:
            peer = ns.link_lookup(ifname=link.peer_if)[0]
            ns.addr("add", index=peer, address=link.peer_ip, prefixlen=24)
            ns.link("set", index=peer, state="up")
            lo = ns.link_lookup(ifname="lo")[0]
            ns.link("set", index=lo, state="up")
    except BaseException:
        link.remove()
        raise
    return link
