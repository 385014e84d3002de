"""The optional fleet key: who may write what a node serves and acts on.

Set on every node and tool of a fleet (``remote_options={"key": ...}``,
``--remote-option key=...``, or the ``BLOCKKV_FLEET_KEY`` environment
variable, the option winning), it makes every header, IDENTITY and GC
completion mark a node writes carry a keyed blake3 MAC over its name and
bytes, and a node then serves and acts on nothing without a valid one
(docs/scale-out.md, "Trust model"). A MANIFEST record is a header's bytes:
it carries that header's seal. Without a key nothing is sealed and nothing
is checked: whoever can write the bucket decides what nodes serve.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

import blake3

from blockkv.format.header import sealed, unsealed

KEY_ENV = "BLOCKKV_FLEET_KEY"
MIN_KEY_CHARS = 16
_CONTEXT = "blockkv 2026-12 fleet key v1"


class FleetKey:
    """A fleet's shared secret, as the MAC key every seal is made with."""

    def __init__(self, secret: str) -> None:
        if not isinstance(secret, str) or len(secret) < MIN_KEY_CHARS:
            raise ValueError(f"a fleet key must be a string of at least {MIN_KEY_CHARS} characters "
                             "(for example 32 random hex digits: python -c 'import secrets; print(secrets.token_hex(16))')")
        self._key = blake3.blake3(secret.encode(), derive_key_context=_CONTEXT).digest()

    def __repr__(self) -> str:
        return "FleetKey(<secret>)"

    def mac(self, kind: str, name: str, data: bytes | memoryview = b"") -> str:
        """The MAC of ``data`` as object ``name`` of ``kind``: bound to both, so a
        sealed object moved to another name, or read as another kind, fails."""
        h = blake3.blake3(key=self._key)
        h.update(f"{kind}\0{name}\0".encode())
        h.update(data)
        return h.hexdigest()

    def _matches(self, kind: str, name: str, data: bytes | memoryview, mac: object) -> bool:
        return isinstance(mac, str) and hmac.compare_digest(self.mac(kind, name, data), mac)

    # -- headers (the seal is a member of their JSON object: format/header.py) ----------------
    def seal_header(self, name: str, data: bytes) -> bytes:
        """A verified header's bytes sealed as ``name`` (a seal it had is replaced)."""
        plain = unsealed(data)
        body = plain[0] if plain is not None else data[:-32]
        return sealed(body + blake3.blake3(body).digest(), self.mac("header", name, body))

    def header_sealed(self, name: str, data: bytes) -> bool:
        """Does ``data`` (digest already verified) carry a valid seal as ``name``?"""
        plain = unsealed(data)
        return plain is not None and self._matches("header", name, plain[0], plain[1])

    # -- IDENTITY --------------------------------------------------------------------------
    def seal_identity(self, directory: str, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "fleet_mac": self.mac("identity", directory, _canonical(body))}

    def identity_sealed(self, directory: str, body: dict[str, Any]) -> bool:
        rest = {k: v for k, v in body.items() if k != "fleet_mac"}
        return self._matches("identity", directory, _canonical(rest), body.get("fleet_mac"))

    # -- GC marks ----------------------------------------------------------------------------
    def marker_body(self, name: str) -> bytes:
        return self.mac("marker", name).encode()

    def marker_sealed(self, name: str, body: bytes) -> bool:
        return self._matches("marker", name, b"", body.decode("ascii", "replace"))

    # -- backlog marks (local: a planted header is never sealed for upload) -------------------
    def backlog_body(self, name: str, header: bytes) -> bytes:
        return self.mac("backlog", name, header).encode()

    def backlog_sealed(self, name: str, header: bytes, body: bytes) -> bool:
        return self._matches("backlog", name, header, body.decode("ascii", "replace"))


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def fleet_key(option: object | None) -> FleetKey | None:
    """The fleet key from ``remote_options["key"]``, else ``BLOCKKV_FLEET_KEY``, else None."""
    secret = option if option is not None else os.environ.get(KEY_ENV) or None
    return None if secret is None else FleetKey(str(secret))
