"""What signing and encryption cost (docs/trust.md, "Cost"), plain and encrypted
measured in the same run:

    /opt/gpusnap/venv/bin/python bench/trust_bench.py [--mib 256] [--out FILE.json]

1. Per chunk, one core: gpusnap.trust.bench (sha256 + zstd -3 [+ seal], and back).
2. End to end against a loopback docker-registry (TLS, htpasswd): one checkpoint
   directory of memory-like pages (1/2 random, 1/4 zero, 1/4 text) pushed plain,
   then signed and encrypted to one P-256 recipient, each to a fresh repository
   with a fresh chunk cache (everything is sent); then pulled with --no-cache,
   plain, and verified + decrypted. Each phase runs twice, alternating plain and
   encrypted, and the best is kept (the host may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpusnap.trust import bench as chunk_bench  # noqa: E402
from tests.integration.oci_registry import PASSWORD, Registry, make_registry  # noqa: E402

GPUSNAP = "/usr/local/bin/gpusnap"


def checkpoint_dir(root: Path, mib: int) -> int:
    """A Podman-shaped checkpoint directory whose pages are memory-like."""
    (root / "checkpoint").mkdir(parents=True)
    (root / "config.dump").write_text(json.dumps({
        "id": uuid.uuid4().hex * 2, "name": "trust-bench", "runtime": "runc",
        "rootfsImageName": "localhost/gpusnap-demo:latest"}))
    (root / "spec.dump").write_text(json.dumps({"ociVersion": "1.0.2", "linux": {}}))
    (root / "checkpoint" / "inventory.img").write_bytes(os.urandom(4096))
    with open(root / "checkpoint" / "pages-1.img", "wb") as f:
        for _ in range(mib // 16):
            f.write(chunk_bench.memory_like(16 << 20))
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def gpusnap(reg: Registry, env: dict, *args: str) -> tuple[dict, float]:
    start = time.monotonic()
    res = subprocess.run([GPUSNAP, *args, *reg.flags(), "--json"], input=PASSWORD + "\n",
                         capture_output=True, text=True, env=env)
    seconds = time.monotonic() - start
    if res.returncode != 0:
        raise SystemExit(f"gpusnap {' '.join(args[:2])} failed: {res.stdout}{res.stderr}")
    return json.loads(res.stdout), seconds


def end_to_end(work: Path, mib: int) -> dict:
    reg = make_registry(work / "registry")
    try:
        keys = work / "keys"
        keys.mkdir()
        for name, kind in (("sign", "ed25519"), ("enc", "ecdsa-p256")):
            subprocess.run([GPUSNAP, "key", "generate", "--type", kind, "-o", str(keys / name)],
                           check=True, capture_output=True)
        policy = work / "policy.json"
        policy.write_text(json.dumps({"default": {"type": "reject"}, "scopes": {
            reg.host: {"type": "signedBy", "keyPaths": [str(keys / "sign.pub")]}}}))
        policy.chmod(0o644)
        src = work / "ckpt"
        size = checkpoint_dir(src, mib)
        base = {**os.environ, "GPUSNAP_POLICY": str(policy),
                "GPUSNAP_DATA_KEY_SECRET": str(work / "secret" / "data-key.secret")}
        variants = {
            "plain": ([], ["--insecure-skip-verify"]),
            "signed+encrypted": (["--sign-key", str(keys / "sign.key"),
                                  "--encrypt-to", str(keys / "enc.pub")],
                                 ["--decrypt-key", str(keys / "enc.key")]),
        }
        best: dict[str, dict] = {v: {} for v in variants}
        for attempt in range(2):
            for variant, (push_flags, pull_flags) in variants.items():
                env = {**base, "GPUSNAP_CACHE_DIR": str(work / f"cache-{variant}-{attempt}")}
                ref = reg.ref(f"bench/{variant.replace('+', '-')}-{uuid.uuid4().hex[:6]}:v1")
                pushed, push_s = gpusnap(reg, env, "push", str(src), ref, *push_flags)
                out = work / "pulled.tar"
                pulled, pull_s = gpusnap(reg, env, "pull", ref, "-o", str(out), "--no-cache",
                                         *pull_flags)
                out.unlink()
                row = best[variant]
                row["push_s"] = min(row.get("push_s", push_s), push_s)
                row["pull_s"] = min(row.get("pull_s", pull_s), pull_s)
                row["bytes_sent"] = pushed["bytes_sent"]
                row["chunks"] = pushed["chunks"]
                row["verified"] = pulled["trust"]["verified"]
        for row in best.values():
            row["push_mb_s"] = round(size / row["push_s"] / 1e6, 1)
            row["pull_mb_s"] = round(size / row["pull_s"] / 1e6, 1)
            row["push_s"], row["pull_s"] = round(row["push_s"], 2), round(row["pull_s"], 2)
        return {"bytes": size, **best}
    finally:
        reg.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="checkpoint size (multiple of 16)")
    ap.add_argument("--out", help="also write the figures as JSON here")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"trust bench: {os.cpu_count()} cores, load {load:.1f}, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    per_chunk = chunk_bench.run(64, 4)
    print("per chunk, one core, MB/s of raw bytes (64 MiB, 4 MiB chunks):")
    for what in ("push", "pull"):
        p, e = per_chunk[f"{what}_plain_mb_s"], per_chunk[f"{what}_encrypted_mb_s"]
        print(f"  {what}: plain {p:7.1f}  encrypted {e:7.1f}  ({100 * (e - p) / p:+.0f}%)")
    print(f"  seal alone: {per_chunk['seal_only_mb_s_of_stored']} MB/s of stored bytes; "
          f"{per_chunk['overhead_bytes']} bytes added for {per_chunk['chunks']} chunks")
    work = Path(tempfile.mkdtemp(prefix="gpusnap-trustbench-", dir="/var/tmp"))
    try:
        e2e = end_to_end(work, args.mib)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"end to end, {e2e['bytes'] / 2**20:.0f} MiB checkpoint directory, loopback "
          "docker-registry (TLS), best of 2, s (MB/s):")
    plain, sealed = e2e["plain"], e2e["signed+encrypted"]
    for what in ("push", "pull"):
        p, s = plain[f"{what}_s"], sealed[f"{what}_s"]
        print(f"  {what}: plain {p:6.2f} ({plain[f'{what}_mb_s']:6.1f})  signed+encrypted "
              f"{s:6.2f} ({sealed[f'{what}_mb_s']:6.1f})  ({100 * (s - p) / p:+.0f}% time)")
    print(f"  sent: plain {plain['bytes_sent']} bytes, encrypted {sealed['bytes_sent']} bytes "
          f"({sealed['chunks']} chunks)")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "cores": os.cpu_count(), "load": round(load, 1),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "per_chunk": per_chunk, "end_to_end": e2e}, indent=2))


if __name__ == "__main__":
    main()
