"""TLS for the lean connection: redis-py's `ssl_*` options, one SSLContext, and errors that name the fix.

The options are read from a redis-py client's connection settings, spelled
as redis-py spells them in URLs and keywords (`ssl_cert_reqs`,
`ssl_ca_certs`, `ssl_ca_data`, `ssl_ca_path`, `ssl_certfile`,
`ssl_keyfile`, `ssl_password`, `ssl_check_hostname`, `ssl_min_version`,
`ssl_ciphers`, ...), with the defaults of the installed redis-py's
`SSLConnection`, and the context is built by redis-py's own
`RedisSSLContext`: a URL means the same on either path.

A certificate the client does not trust, a name the certificate does not
carry, a client certificate the server refuses, or a port that does not
speak TLS will fail the same way on every retry: `TlsMisconfigured` says
which setting to change, and the core reports it as RedisMisconfigured
(never counted by the circuit breaker, never a reason to run a `fail_open`
route unlocked). A handshake cut short by the network stays transient.
"""

from __future__ import annotations

import asyncio
import inspect
import ssl
from typing import Any

from redis.asyncio.connection import RedisSSLContext, SSLConnection
from redis.exceptions import ConnectionError as RedisConnectionError

# redis-py's SSLConnection keywords and their defaults (they differ between releases: check_hostname)
_DEFAULTS = {name: p.default for name, p in inspect.signature(SSLConnection.__init__).parameters.items()
             if name.startswith("ssl_")}
_CONTEXT_ARGS = set(inspect.signature(RedisSSLContext.__init__).parameters)

# OpenSSL reasons that no retry can change, each with what to do about it
_CLIENT_CERT = ("the server requires a client certificate it trusts (tls-auth-clients): give ssl_certfile= "
                "and ssl_keyfile= with a certificate signed by the server's tls-ca-cert-file")
_NO_TLS = ("the server does not speak TLS on this port: use redis:// for a plain port, or the server's "
           "tls-port with rediss://")
_NO_COMMON = ("client and server share no TLS version or cipher: check ssl_min_version= and ssl_ciphers= "
              "against the server's tls-protocols and tls-ciphers")
_REASONS = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": _CLIENT_CERT,
    "SSLV3_ALERT_BAD_CERTIFICATE": _CLIENT_CERT,
    "TLSV1_ALERT_UNKNOWN_CA": _CLIENT_CERT,
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": _CLIENT_CERT,
    "TLSV1_ALERT_ACCESS_DENIED": _CLIENT_CERT,
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the server refuses the client certificate as expired: renew ssl_certfile=",
    "WRONG_VERSION_NUMBER": _NO_TLS,
    "RECORD_LAYER_FAILURE": _NO_TLS,
    "PACKET_LENGTH_TOO_LONG": _NO_TLS,
    "TLSV1_ALERT_PROTOCOL_VERSION": _NO_COMMON,
    "UNSUPPORTED_PROTOCOL": _NO_COMMON,
    "NO_PROTOCOLS_AVAILABLE": _NO_COMMON,
    "NO_SHARED_CIPHER": _NO_COMMON,
    "NO_CIPHERS_AVAILABLE": _NO_COMMON,
    "SSLV3_ALERT_HANDSHAKE_FAILURE": ("the server refused the handshake: it may require a client certificate "
                                      "(ssl_certfile=, ssl_keyfile=), or share no TLS version or cipher with the "
                                      "client (ssl_min_version=, ssl_ciphers=)"),
}
# What the text of a wrapped error (redis-py's path) shows of a certificate the client refused
_VERIFY_WORDS = ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed")
WORDS = (*_VERIFY_WORDS, *_REASONS)  # in an error's text: a TLS failure no retry can fix


class TlsMisconfigured(RedisConnectionError):
    """A TLS failure no retry can fix; `fix` says which setting to change.

    A redis-py ConnectionError, so code that handles a lost connection still
    handles it; the core's error rules (`_errors.py`) make it RedisMisconfigured.
    """

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


class _Listener(asyncio.Protocol):
    """Waits for the server's first word: `heard` is None for data, or the error the connection ended with."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.heard: asyncio.Future[BaseException | None] = loop.create_future()

    def data_received(self, data: bytes) -> None:
        if not self.heard.done():
            self.heard.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.heard.done():
            self.heard.set_result(exc)


class Tls:
    """The TLS settings of one client; the SSLContext is built once, on the first connect."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = {**_DEFAULTS, **{k: v for k, v in options.items() if k in _DEFAULTS}}
        self._context: ssl.SSLContext | None = None

    @classmethod
    def of(cls, connection_class: Any, kw: dict[str, Any]) -> "Tls | None":
        """The TLS settings of a client whose connections are `connection_class` with `kw`; None for plain TCP."""
        tls = isinstance(connection_class, type) and issubclass(connection_class, SSLConnection)
        return cls(kw) if tls or kw.get("ssl") else None

    def __repr__(self) -> str:
        return f"<Tls ca_certs={self.options.get('ssl_ca_certs')!r} certfile={self.options.get('ssl_certfile')!r}>"

    def context(self) -> ssl.SSLContext:
        """redis-py's context for these options; a file that cannot be loaded is TlsMisconfigured."""
        if self._context is None:
            args = {name[4:]: value for name, value in self.options.items() if name[4:] in _CONTEXT_ARGS}
            try:
                self._context = RedisSSLContext(**args).get()
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                files = ", ".join(f"{k}={v!r}" for k, v in self.options.items()
                                  if k in ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile") and v)
                raise TlsMisconfigured(f"TLS settings cannot be loaded: {exc}",
                                       f"check that {files or 'the ssl_* files'} exist, are readable, and hold "
                                       "PEM certificates (and the key that matches ssl_certfile)") from exc
        return self._context

    def refusal(self, error: BaseException, server: str) -> TlsMisconfigured | None:
        """The error as TlsMisconfigured when it is a TLS failure no retry can fix; None when transient."""
        if not isinstance(error, ssl.SSLError):
            return None
        fix = self._verify_fix(error, server) if isinstance(error, ssl.SSLCertVerificationError) else \
            fix_for(str(error))
        if fix is None:
            return None
        return TlsMisconfigured(f"TLS with {server} failed: {error}", fix)

    async def diagnose(self, host: str, port: int, timeout: float) -> TlsMisconfigured | None:
        """Why a server hung up on a new TLS connection, when a certificate is why; None otherwise.

        TLS 1.3 lets the client finish its handshake before the server checks
        the client's certificate: a refusal comes as an alert after the
        client's first command, and the reset that follows it can arrive
        first and hide it. A second connection that sends nothing reads the
        alert itself. Only asked when a TLS connection was lost before its
        first reply; a server that accepts it stays silent until `timeout`.
        """
        loop = asyncio.get_running_loop()
        listener = _Listener(loop)
        transports: list[asyncio.Transport] = []
        try:
            async with asyncio.timeout(timeout):
                raw, _ = await loop.create_connection(lambda: listener, host, port)
                transports.append(raw)
                tls = await loop.start_tls(raw, listener, self.context(), server_hostname=host)
                if tls is not None:
                    transports.append(tls)
                lost = await listener.heard
        except (OSError, TimeoutError) as exc:
            lost = exc
        finally:
            for transport in reversed(transports):
                transport.abort()
        return None if lost is None else self.refusal(lost, f"{host}:{port}")

    def _verify_fix(self, error: ssl.SSLCertVerificationError, server: str) -> str:
        code, message = error.verify_code, str(error.verify_message or error)
        host = server.rsplit(":", 1)[0]
        if code == 62 or "mismatch" in message:  # X509_V_ERR_HOSTNAME_MISMATCH / IP address mismatch
            return (f"the server's certificate does not name {host}: connect by a name or address its "
                    "subjectAltName lists, or reissue the certificate for this one (ssl_check_hostname=False "
                    "turns the check off, and with it protection from impostors)")
        if code in (10, 9):  # expired / not yet valid
            return f"the server's certificate is {message}: renew it on the server (or fix a clock)"
        bundle = ", ".join(f"{k}={v!r}" for k in ("ssl_ca_certs", "ssl_ca_path") if (v := self.options.get(k)))
        where = bundle or ("ssl_ca_data=" if self.options.get("ssl_ca_data") else
                           "the system's CA bundle (no ssl_ca_certs given)")
        return (f"the server's certificate is not signed by a CA in {where} ({message}): give the CA that "
                "signed it as ssl_ca_certs=PATH (or ssl_ca_data=PEM)")


def fix_for(text: str) -> str | None:
    """The fix for a TLS failure known from its text alone (redis-py's wrapped errors too); None if transient."""
    if any(word in text for word in _VERIFY_WORDS):
        if "mismatch" in text:
            return ("the server's certificate does not name the host in the URL: connect by a name its "
                    "subjectAltName lists, or reissue the certificate")
        return ("the client does not trust the server's certificate: give the CA that signed it as "
                "ssl_ca_certs=PATH (or ssl_ca_data=PEM), or renew an expired certificate")
    return next((fix for reason, fix in _REASONS.items() if reason in text), None)
