"""Bundle signatures in the OpenSSF model-signing format (the `model-signing` package, key-based, offline).

`sign` hashes every file of a bundle folder (manifest.json included) into a signed in-toto statement,
stored as `model.sig` (a Sigstore bundle) at the bundle's root. `verify` re-hashes the folder and checks
the statement against a public key. Nothing in the bundle is parsed before that: a file and its hash
in manifest.json rewritten together fail here, because the signed statement covers manifest.json too.

Keys: EC PEM (P-256, P-384 or P-521). A password-protected private key takes its password from the
environment variable PIPELINE_SIGN_KEY_PASSWORD.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from pipeline.core.errors import ConfigError, IntegrityError

SIGNATURE = "model.sig"
FORMAT = "OpenSSF model-signing (Sigstore bundle, elliptic-curve key)"
PASSWORD_ENV = "PIPELINE_SIGN_KEY_PASSWORD"


def _hashing():
    from model_signing import hashing

    # the signature file itself is not part of what it signs
    return hashing.Config().use_file_serialization(hashing_algorithm="sha256").set_ignored_paths(
        paths=[SIGNATURE], ignore_git_paths=False)


def _key_file(key: str | Path, what: str) -> Path:
    path = Path(key)
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}", hint="pass the PEM file of an EC key (see docs/security.md: signed bundles)")
    return path


def is_signed(folder: Path) -> bool:
    return (Path(folder) / SIGNATURE).is_file()


def sign(folder: Path, private_key: str | Path) -> Path:
    """Write folder/model.sig signing every file in folder; returns its path."""
    from model_signing import signing

    folder, key = Path(folder), _key_file(private_key, "signing key")
    try:
        cfg = signing.Config().use_elliptic_key_signer(private_key=key, password=os.environ.get(PASSWORD_ENV))
    except (ValueError, TypeError) as exc:       # not PEM, wrong/missing password, unsupported curve
        raise ConfigError(f"cannot use {key} as a signing key: {exc}",
                          hint=f"an EC private key in PEM; a password goes in ${PASSWORD_ENV}") from None
    sig = folder / SIGNATURE
    sig.unlink(missing_ok=True)
    try:
        cfg.set_hashing_config(_hashing()).sign(folder, sig)
    except ValueError as exc:                    # e.g. a symlink inside the folder
        sig.unlink(missing_ok=True)
        raise IntegrityError(f"cannot sign {folder}: {exc}") from None
    return sig


def verify(folder: Path, public_key: str | Path) -> None:
    """Raise IntegrityError unless folder/model.sig is a valid signature by public_key over every file."""
    from model_signing import verifying

    folder, key = Path(folder), _key_file(public_key, "public key")
    sig = folder / SIGNATURE
    if not sig.is_file():
        raise IntegrityError(f"bundle {folder.name} is unsigned (no {SIGNATURE}) but a key was given to check it",
                             hint="sign it: python -m pipeline sign BUNDLE --key PRIVATE.pem")
    try:
        cfg = verifying.Config().use_elliptic_key_verifier(public_key=key)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"cannot use {key} as a public key: {exc}", hint="pass the EC public key in PEM") from None
    try:
        cfg.set_hashing_config(_hashing()).verify(folder, sig)
    except Exception as exc:                     # the library raises ValueError and protobuf/JSON errors alike
        raise IntegrityError(f"signature check failed for {folder.name}: {_why(str(exc))}",
                             hint="the bundle was modified after signing, or signed with another key") from None


def _why(text: str) -> str:
    """model-signing's mismatch report (digests as byte reprs) → which files changed, were added or removed."""
    parts = []
    changed = re.findall(r"Hash mismatch for \\?'([^'\\]+)", text)
    if changed:
        parts.append(f"changed since signing: {', '.join(changed[:5])}")
    for kind, label in (("Extra", "added since signing"), ("Missing", "removed since signing")):
        m = re.search(kind + r" files (?:found )?in model '[^']*': ([^\"\]]+)", text)
        if m:
            parts.append(f"{label}: {m.group(1).strip()}")
    return "; ".join(parts) if parts else " ".join(text.split())[:300]


def public_key_pem(private_key: str | Path) -> bytes:
    """The public half of a PEM private key (the bundle stage checks its own signature with it)."""
    from cryptography.hazmat.primitives import serialization

    key = _key_file(private_key, "signing key")
    password = os.environ.get(PASSWORD_ENV)
    try:
        priv = serialization.load_pem_private_key(key.read_bytes(), password.encode() if password else None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"cannot use {key} as a signing key: {exc}",
                          hint=f"an EC private key in PEM; a password goes in ${PASSWORD_ENV}") from None
    return priv.public_key().public_bytes(serialization.Encoding.PEM,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)
