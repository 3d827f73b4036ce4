"""Client-side TLS contexts for the pool's internal hops (sidecar -> engines, gateway ->
sidecars): verified against the pool's CA bundle."""

from __future__ import annotations

import ssl


def client_context(ca_file: str, any_name: bool = False) -> ssl.SSLContext:
    """Certificates must chain to `ca_file`. `any_name`: do not match the certificate's
    names against the host connected to (pods are reached at IPs no certificate names in
    advance); the chain is still verified, so the CA must be dedicated to the pool."""
    context = ssl.create_default_context(cafile=ca_file)
    if any_name:
        context.check_hostname = False  # verify_mode stays CERT_REQUIRED
    return context
