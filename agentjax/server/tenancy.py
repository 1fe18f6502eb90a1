"""API keys and tenants: which key may call which route, and whose prefix cache a request reads.

A `KeyRing` holds the server's keys (`--api-key`, repeatable, and `$AGENTJAX_API_KEY`; `--api-keys-file`)
and its operator keys (`--operator-key`; `"operator": true` in the file). Each key is a `Tenant` with a
cache namespace: by default one of its own, derived from the key; keys the file gives the same
`namespace` name share one (agents of one team). The namespace is mixed into the root of the chained
block hashes (`agentjax.kv.hashing.namespaced_salt`), so it reaches every tier's page keys and the
router's KV events. Never logs or returns a key; keys are looked up by their SHA-256 digest.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentjax.errors import ServerConfigError
from agentjax.kv.hashing import namespaced_salt

API_KEY_ENV = "AGENTJAX_API_KEY"
OPERATOR_KEY_ENV = "AGENTJAX_OPERATOR_KEY"
TENANT_SCOPE_KEY = "agentjax.tenant"  # the ASGI scope entry the guard fills for each request
TENANT_KEY_HEADER = "x-agentjax-tenant-key"  # an operator names the tenant it asks about (router)
MAX_NAMESPACE_CHARS = 128
_KEY_FIELDS = {"key", "namespace", "operator"}


@dataclass(frozen=True)
class Tenant:
    """Who sent a request: its cache namespace (None on a server without keys: one shared cache),
    whether it holds an operator key, and a label for logs (never the key)."""

    namespace: str | None
    operator: bool = False
    label: str = "open"

    def salt(self, cache_salt: str | None) -> str | None:
        """The salt the request's blocks are hashed under (its namespace, then its `cache_salt`)."""
        return namespaced_salt(self.namespace, cache_salt)

    def session(self, session_id: str | None) -> str | None:
        """The engine's name for the request's session: tenants' session ids never meet."""
        if session_id is None or self.namespace is None:
            return session_id
        return f"{self.namespace}/{session_id}"


OPEN_TENANT = Tenant(None, operator=True)


def key_fingerprint(key: str) -> str:
    return hashlib.sha256(b"agentjax.cache-namespace\x00" + key.encode()).hexdigest()[:32]


class KeyRing:
    """The keys a server accepts, each with its `Tenant`. Empty: the server is open."""

    def __init__(self, tenants: Mapping[bytes, Tenant] | None = None):
        self._by_digest: dict[bytes, Tenant] = dict(tenants or {})

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    @property
    def has_operator(self) -> bool:
        return any(tenant.operator for tenant in self._by_digest.values())

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenant_for(self, key: bytes | str | None) -> Tenant | None:
        """The key's tenant; None for a missing or unknown key (OPEN_TENANT when no key is set)."""
        if not self.enabled:
            return OPEN_TENANT
        if not key:
            return None
        raw = key.encode() if isinstance(key, str) else key
        return self._by_digest.get(hashlib.sha256(raw).digest())

    @classmethod
    def build(cls, api_keys: Iterable[str] = (), operator_keys: Iterable[str] = (),
              keys_file: str | os.PathLike | None = None) -> KeyRing:
        """Keys from flags and a keys file; a key named twice must say the same thing each time."""
        entries: list[tuple[str, str | None, bool, str]] = []
        entries += [(key.strip(), None, False, "--api-key") for key in api_keys if key and key.strip()]
        entries += [(key.strip(), None, True, "--operator-key") for key in operator_keys if key and key.strip()]
        if keys_file is not None:
            entries += read_keys_file(keys_file)
        tenants: dict[bytes, Tenant] = {}
        for key, name, operator, where in entries:
            if name is not None:
                tenant = Tenant(f"name:{name}", operator, f"namespace {name!r}")
            else:
                fingerprint = key_fingerprint(key)
                tenant = Tenant(f"key:{fingerprint}", operator, f"key {fingerprint[:8]}")
            digest = hashlib.sha256(key.encode()).digest()
            known = tenants.get(digest)
            if known is not None and known != tenant:
                if known.namespace == tenant.namespace:  # an operator flag on a tenant key: operator
                    tenant = Tenant(tenant.namespace, True, tenant.label)
                else:
                    raise ServerConfigError(f"a key from {where} is also given with another namespace; "
                                            "name each key once")
            tenants[digest] = tenant
        return cls(tenants)


def read_keys_file(path: str | os.PathLike) -> list[tuple[str, str | None, bool, str]]:
    """(key, namespace name or None, operator, where) of each entry of a keys file:
    `{"keys": [{"key": "...", "namespace": "team-a", "operator": false}, ...]}`."""
    where = f"keys file {path}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ServerConfigError(f"cannot read the {where}: {error}") from None
    items = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise ServerConfigError(f'the {where} must hold {{"keys": [{{"key": "...", "namespace": "...", '
                                f'"operator": false}}, ...]}} with at least one key')
    return [_entry(item, f"{where}, keys[{index}]") for index, item in enumerate(items)]


def _entry(item: Any, where: str) -> tuple[str, str | None, bool, str]:
    if not isinstance(item, dict) or not isinstance(item.get("key"), str) or not item["key"].strip():
        raise ServerConfigError(f"{where}: each entry is an object with a non-empty string \"key\"")
    unknown = set(item) - _KEY_FIELDS
    if unknown:
        raise ServerConfigError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_KEY_FIELDS)}")
    name = item.get("namespace")
    if name is not None and (not isinstance(name, str) or not name or len(name) > MAX_NAMESPACE_CHARS
                             or not name.isprintable()):
        raise ServerConfigError(f"{where}: \"namespace\" must be a printable string of 1 to "
                                f"{MAX_NAMESPACE_CHARS} characters")
    operator = item.get("operator", False)
    if not isinstance(operator, bool):
        raise ServerConfigError(f"{where}: \"operator\" must be true or false")
    return item["key"].strip(), name, operator, where


def presented_key(headers: Mapping[bytes, bytes]) -> bytes | None:
    """The key a request presents: `Authorization: Bearer KEY`, else Anthropic's `x-api-key`."""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return token.strip()
    return headers.get(b"x-api-key", b"").strip() or None


def tenant_of(scope: Mapping[str, Any]) -> Tenant:
    """The tenant the guard found for this request (OPEN_TENANT on an app without the guard)."""
    return scope.get(TENANT_SCOPE_KEY, OPEN_TENANT)
