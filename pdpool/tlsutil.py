"""TLS for the pool's internal hops (sidecar -> engines, gateway -> sidecars): client
contexts verified against the pool's CA bundle, and a CA with a certificate made on the
spot for `pdpool up --tls`, the test clusters and the tests."""

from __future__ import annotations

import os
import ssl
import subprocess


def client_context(ca_file: str, any_name: bool = False) -> ssl.SSLContext:
    """Certificates must chain to `ca_file`. `any_name`: do not match the certificate's
    names against the host connected to (pods are reached at IPs no certificate names in
    advance); the chain is still verified, so the CA must be dedicated to the pool."""
    context = ssl.create_default_context(cafile=ca_file)
    if any_name:
        context.check_hostname = False  # verify_mode stays CERT_REQUIRED
    return context


def openssl(*args: str, cwd: str | os.PathLike[str]) -> None:
    """Runs `openssl ARGS` in `cwd`; RuntimeError with openssl's own words when it fails."""
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def make_ca_and_certificate(
    directory: str | os.PathLike[str],
    san: str = "IP:127.0.0.1,DNS:localhost",
    *,
    ca_name: str = "ca",
    ca_cn: str = "pdpool-ca",
    name: str = "tls",
    cn: str = "pdpool",
    days: int = 7,
    server_auth: bool = True,
) -> tuple[str, tuple[str, str]]:
    """A CA (`ca_name`.crt and .key) and a certificate it signs for the names in `san`
    (`name`.crt and .key), valid for `days`, made with openssl in `directory`; the keys are
    readable by this user only. `server_auth`: the certificate may only serve. Returns
    (the CA's certificate, (the certificate, its key)), as the TLS flags take them."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    ca_crt, ca_key = f"{ca_name}.crt", f"{ca_name}.key"
    crt, key, csr, ext = f"{name}.crt", f"{name}.key", f"{name}.csr", f"{name}-san.cnf"
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", str(days),
        "-subj", f"/CN={ca_cn}", "-keyout", ca_key, "-out", ca_crt,
        cwd=directory,
    )  # fmt: skip
    with open(os.path.join(directory, ext), "w", encoding="utf-8") as fh:
        fh.write(f"subjectAltName={san}\n")
        if server_auth:
            fh.write("extendedKeyUsage=serverAuth\n")
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", key,
        "-out", csr,
        cwd=directory,
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial",
        "-days", str(days), "-extfile", ext, "-out", crt,
        cwd=directory,
    )  # fmt: skip
    for secret in (ca_key, key):
        os.chmod(os.path.join(directory, secret), 0o600)
    return os.path.join(directory, ca_crt), (
        os.path.join(directory, crt),
        os.path.join(directory, key),
    )
