"""The restore-time decision: does the policy accept this checkpoint?

Pure: the caller fetches the signature manifest (tag signature.signature_tag
of the checkpoint's digest; None when the registry has no such tag) and
passes a blob fetcher. Call it after the checkpoint manifest was read and
before any chunk is downloaded; pin every later read to ``manifest_digest``.
"""

from __future__ import annotations

from gpusnap.errors import GpusnapError
from gpusnap.oci.reference import Reference
from gpusnap.trust import hostkey, signature
from gpusnap.trust.policy import Policy

# How a host comes to trust another's pushes (no policy file: trust/hostkey.py).
# A push signs with --sign-key's keys, else with its host's own: either public half serves.
TRUST_STEPS = ("on the host that pushed it run `gpusnap key export -o signer.pub` (pushed with "
               "--sign-key: take the .pub beside that key instead), copy signer.pub here and "
               "run `gpusnap key trust signer.pub`")
SKIP_WARNING = ("signature verification skipped (--insecure-policy): this checkpoint "
                "runs as root with nobody vouching for it")


def check(policy: Policy, ref: Reference, manifest_digest: str, signature_manifest: bytes | None,
          fetch: signature.FetchBlob, skip_verify: bool = False) -> dict:
    """What was decided, for --json output; a refusal is one GpusnapError."""
    req = policy.for_reference(ref)
    base = {"policy": policy.where, "scope": req.scope,
            "requirement": req.type, "digest": manifest_digest}
    if skip_verify:
        return {**base, "verified": False, "skipped": True, "warning": SKIP_WARNING}
    where = f"{ref.registry}/{ref.repository}@{manifest_digest}"
    if req.type == "insecureAcceptAnything":
        return {**base, "verified": False, "skipped": False,
                "warning": f"the policy accepts anything for {req.scope}: not verified"}
    if req.type == "reject":
        if policy.source is None:
            raise GpusnapError(f"{where}: no trust policy (/etc/gpusnap/policy.json) and no "
                               f"trusted keys ({hostkey.trusted_dir()}), so no checkpoint is "
                               "trusted", f"{TRUST_STEPS}; or pass --insecure-policy to restore "
                               "it unverified")
        raise GpusnapError(f"{where}: the policy {policy.source} rejects checkpoints from "
                           f"{req.scope if req.scope != 'default' else 'this registry'}",
                           "add a signedBy scope for it, or pass --insecure-policy")
    if signature_manifest is None:
        raise GpusnapError(f"{where} is not signed (no {signature.signature_tag(manifest_digest)} "
                           "tag)", "push it with --sign-key KEY, or pass --insecure-policy "
                           "to restore it unverified; nothing was restored")
    try:
        ok = signature.verify_artifact(signature_manifest, fetch,
                                       f"{ref.registry}/{ref.repository}", manifest_digest,
                                       req.keys, req.match_repository, where)
    except signature.UntrustedSigner as exc:
        if policy.source is not None:
            raise
        raise GpusnapError(f"{exc.where} is signed only by keys this host does not trust "
                           f"({exc.key_ids})", f"{TRUST_STEPS}; nothing was restored") from None
    return {**base, "verified": True, "skipped": False, "key_id": ok.key_id,
            "algorithm": ok.algorithm}
