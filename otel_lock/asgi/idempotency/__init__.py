"""Idempotency-Key (draft-ietf-httpapi-idempotency-key-header, Stripe practice).

A request of an `@idempotent` route passes these steps, one module each:

    _options      `idempotent(...)`: the route's settings, checked when it is decorated
    _key          the Idempotency-Key header, validated (400 when ill-formed)
    _principal    whose key it is: the app names the caller (401 with a challenge when nobody);
                  `_principal_dependency` when it is a FastAPI Depends(...)
    _fingerprint  what makes a retry "the same request" (method, scheme and host, target, body, inputs);
                  a multipart body by its parts as python-multipart reads them (`_multipart`, `_mime`)
    _fingerprint_inputs  the headers and cookies the handler declares or its lock key names
    _versions     which fingerprint a stored record carries (`fpv` 3); version 2's in `_fingerprint_v2`,
                  0.1.0's in `_fingerprint_v1`
    _gate         the walk itself: replay, 422, 409, claim, run, store (IdempotencyGate)
    _answer       which answers are stored, and how a stored one is replayed (RFC 9110)
    _store        where records live, bounded per principal and in total (IdempotencyStore)
    _legacy       release 0.1.0's record layout, written and read too for one release

The middleware calls the gate once the request body is buffered; nothing
else of the ASGI layer reaches inside.
"""

from ._gate import IdempotencyGate, Inner
from ._key import KEY_PATTERN, MAX_KEY, IdempotencyKeyError, parse_key
from ._options import Idempotent, idempotent
from ._principal import Principal
from ._store import IdempotencyStore
from ._store_errors import RecordStoreMisconfigured, RecordStoreUnavailable

__all__ = ["KEY_PATTERN", "MAX_KEY", "IdempotencyGate", "IdempotencyKeyError", "IdempotencyStore", "Idempotent",
           "Inner", "Principal", "RecordStoreMisconfigured", "RecordStoreUnavailable", "idempotent", "parse_key"]
