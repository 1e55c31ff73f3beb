"""The one-node cluster's certificates and kubeconfigs, made with the openssl command line.

Kubernetes' own ``hack/local-up-cluster.sh`` is the model: one CA signs every serving and client certificate,
clients are told apart by CN (user) and O (groups), the service-account tokens have a key pair of their own.
Elliptic-curve keys (P-256) keep ``up`` fast; the service-account key is RSA, the kind every verifier takes.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL_TIMEOUT = 60.0
DAYS = "30"


class PKIError(RuntimeError):
    """openssl failed; the message names the certificate."""


@dataclass(frozen=True)
class Identity:
    """One certificate: its file stem, subject and (for servers) subject alternative names."""

    name: str
    cn: str
    groups: tuple[str, ...] = ()
    sans: tuple[str, ...] = ()
    server: bool = False


def _openssl(args: list[str], what: str) -> None:
    try:
        done = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=OPENSSL_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PKIError(f"openssl for {what}: {exc}") from exc
    if done.returncode != 0:
        raise PKIError(f"openssl for {what} exited {done.returncode}: {done.stderr.strip()[-400:]}")


def make_ca(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    key, crt = directory / "ca.key", directory / "ca.crt"
    if crt.exists() and key.exists():
        return
    _openssl(["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key)], "the CA key")
    _openssl(
        [
            "req",
            "-x509",
            "-new",
            "-key",
            str(key),
            "-sha256",
            "-days",
            DAYS,
            "-subj",
            "/CN=kgp-cluster-ca",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-out",
            str(crt),
        ],
        "the CA certificate",
    )


def issue(directory: Path, who: Identity) -> None:
    """``<name>.key``/``<name>.crt`` signed by the CA in ``directory`` (made by :func:`make_ca`)."""
    key, csr, crt = (directory / f"{who.name}.{ext}" for ext in ("key", "csr", "crt"))
    if crt.exists() and key.exists():
        return
    subject = "".join(f"/O={group}" for group in who.groups) + f"/CN={who.cn}"
    _openssl(["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key)], f"{who.name}'s key")
    _openssl(["req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr)], f"{who.name}'s request")
    usage = "serverAuth" if who.server else "clientAuth"
    extensions = directory / f"{who.name}.ext"
    lines = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ]
    if who.sans:
        lines.append("subjectAltName=" + ",".join(who.sans))
    extensions.write_text("\n".join(lines) + "\n")
    _openssl(
        [
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(directory / "ca.crt"),
            "-CAkey",
            str(directory / "ca.key"),
            "-CAcreateserial",
            "-days",
            DAYS,
            "-sha256",
            "-extfile",
            str(extensions),
            "-out",
            str(crt),
        ],
        f"{who.name}'s certificate",
    )
    csr.unlink()
    extensions.unlink()


def make_service_account_keys(directory: Path) -> None:
    key, pub = directory / "service-account.key", directory / "service-account.pub"
    if key.exists() and pub.exists():
        return
    _openssl(
        ["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(key)],
        "the service-account key",
    )
    _openssl(["pkey", "-in", str(key), "-pubout", "-out", str(pub)], "the service-account public key")


def kubeconfig(path: Path, *, server: str, pki: Path, user: str) -> None:
    """A kubeconfig for ``user``'s certificate (``<user>.crt``/``.key`` in ``pki``), trusting the CA by file."""
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: kgp\n  cluster:\n    server: {server}\n    certificate-authority: {pki / 'ca.crt'}\n"
        f"users:\n- name: {user}\n  user:\n    client-certificate: {pki / (user + '.crt')}\n"
        f"    client-key: {pki / (user + '.key')}\n"
        f"contexts:\n- name: kgp\n  context:\n    cluster: kgp\n    user: {user}\n"
        "current-context: kgp\n"
    )
