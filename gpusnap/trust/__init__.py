"""Trust and secrecy of checkpoints: keys, signatures, the trust policy, chunk
encryption. Pure functions on bytes and files; the registry calls live in
gpusnap/ops (see docs/trust.md)."""

# Here, not in keys.py: the CLI names them at import time, before `cryptography`
# is needed (a GPU host may run gpusnap without it).
KEY_TYPES = ("ed25519", "ecdsa-p256")
PASSPHRASE_ENV = "GPUSNAP_KEY_PASSPHRASE"
