"""A target's TLS settings (``target.tls``) loaded as the transports use them.

``h1`` and aiohttp take an ``ssl.SSLContext`` (``ssl_context``); grpcio takes
the PEM bytes themselves (``pem_files``). Both are made when the transport is
made, so that a file that is missing, unreadable or not what its field says
(no certificate in ``ca_file``, a key that does not match ``cert_file``, an
encrypted key) is a ``ConfigError`` naming the field and the path at start or
reload, never a TLS error at the first delivery.

The files are read again whenever the integration is built: a reload
restarts an integration whose files changed on disk (``tls_files`` lists
them for the reload to compare and watch), and keeps the running version
when the new ones do not load.

The handler's certificate is always verified and its name checked: there is
deliberately no setting that turns either off. Without ``ca_file`` the
system's CA store is used (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` name another
for the whole process); with it, only the CAs in that file are trusted.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from nemesis.config.models import TlsConfig
from nemesis.errors import ConfigError, ConfigProblem


@dataclass(frozen=True, slots=True)
class PemFiles:
    """The PEM bytes of ``target.tls``, named as ``grpc.ssl_channel_credentials`` takes them."""

    root_certificates: bytes | None  # ca_file; None: the default roots
    certificate_chain: bytes | None  # cert_file
    private_key: bytes | None  # key_file


def tls_files(tls: TlsConfig | None) -> list[Path]:
    """The files ``tls`` names, as given (a relative path is read from the working directory)."""
    if tls is None:
        return []
    return [Path(path) for path in (tls.ca_file, tls.cert_file, tls.key_file) if path is not None]


def ssl_context(tls: TlsConfig | None, *, where: str) -> ssl.SSLContext:
    """A client context that verifies the handler: against ``tls.ca_file`` or the system's CAs.

    With ``tls.cert_file`` it presents that client certificate (mutual TLS).
    Raises ``ConfigError`` (file ``where``, field ``target.tls.*``) when a
    file cannot be loaded.
    """
    if tls is None or tls.ca_file is None:
        context = ssl.create_default_context()
    else:
        # Given a file, create_default_context trusts its CAs instead of the system's.
        context = _trusting(tls.ca_file, "ca_file", where)
    if tls is not None and tls.cert_file is not None and tls.key_file is not None:
        _load_client_certificate(context, tls.cert_file, tls.key_file, where)
    return context


def pem_files(tls: TlsConfig | None, *, where: str) -> PemFiles:
    """The files of ``tls`` as bytes, once ``ssl_context`` found that they load."""
    if tls is None:
        return PemFiles(None, None, None)
    ssl_context(tls, where=where)
    return PemFiles(
        root_certificates=_read(tls.ca_file, "ca_file", where),
        certificate_chain=_read(tls.cert_file, "cert_file", where),
        private_key=_read(tls.key_file, "key_file", where),
    )


def _trusting(path: str, field: str, where: str) -> ssl.SSLContext:
    """A client context trusting the certificates in ``path`` alone; ``ConfigError`` if none."""
    try:
        return ssl.create_default_context(cafile=path)
    except ssl.SSLError:  # before OSError, its base class
        message = f"{path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
        raise _problem(where, field, message) from None
    except OSError as exc:
        raise _problem(where, field, _unreadable(path, exc)) from None


class _PasswordAsked(Exception):
    """OpenSSL asked for the key's password: the key is encrypted."""


def _no_password() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal and hang the start.
    raise _PasswordAsked


def _load_client_certificate(
    context: ssl.SSLContext, cert_file: str, key_file: str, where: str
) -> None:
    # load_cert_chain says only "PEM lib" for a bad certificate or a bad key alike: the
    # certificate is tried alone first, so the problem names the file at fault.
    _trusting(cert_file, "cert_file", where)
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_password)
    except _PasswordAsked:
        message = (
            f"{key_file} is encrypted: give the key unencrypted (protect the file by its"
            " permissions or a mounted secret instead)"
        )
        raise _problem(where, "key_file", message) from None
    except ssl.SSLError as exc:  # before OSError, its base class
        if exc.reason == "KEY_VALUES_MISMATCH":
            message = f"{key_file} is not the private key of the certificate in {cert_file}"
        else:
            message = f"{key_file} holds no PEM private key (-----BEGIN PRIVATE KEY-----)"
        raise _problem(where, "key_file", message) from None
    except OSError as exc:
        # Only the key can be unreadable here: the certificate was just read.
        raise _problem(where, "key_file", _unreadable(key_file, exc)) from None


def _read(path: str | None, field: str, where: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise _problem(where, field, _unreadable(path, exc)) from None


def _unreadable(path: str, exc: OSError) -> str:
    return f"cannot read {path}: {exc.strerror or type(exc).__name__}"


def _problem(where: str, field: str, message: str) -> ConfigError:
    return ConfigError([ConfigProblem(where, None, f"target.tls.{field}", message)])
