"""Keys, tenants and cache namespaces: what `--api-key`, `--operator-key` and `--api-keys-file` build,
and how a tenant's namespace changes every block hash of its prompts."""
from __future__ import annotations

import json

import pytest

from agentjax.errors import ServerConfigError
from agentjax.kv.hashing import block_hashes
from agentjax.server.tenancy import OPEN_TENANT, KeyRing, presented_key

PROMPT = list(range(100, 164))


def write_keys(tmp_path, entries) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": entries}))
    return str(path)


def test_each_key_gets_its_own_namespace_and_a_keys_file_can_share_one(tmp_path):
    keys_file = write_keys(tmp_path, [{"key": "t1", "namespace": "team"}, {"key": "t2", "namespace": "team"},
                                      {"key": "ops", "operator": True}])
    ring = KeyRing.build(["a", "b", " a "], ["root"], keys_file)
    a, b, t1, t2 = (ring.tenant_for(k) for k in ("a", "b", "t1", "t2"))
    assert len({a.namespace, b.namespace, t1.namespace}) == 3 and t1 == t2
    assert not a.operator and ring.tenant_for("ops").operator and ring.tenant_for(b"root").operator
    assert ring.tenant_for("nope") is None and ring.tenant_for(None) is None and ring.tenant_for("") is None
    assert KeyRing.build(["a"]).tenant_for("a") == a  # derived from the key: the same on every start
    secret = KeyRing.build(["sk-very-secret"]).tenant_for("sk-very-secret")
    assert "very-secret" not in repr(secret) and secret.label.startswith("key ")  # a fingerprint, never the key


def test_a_ring_without_keys_is_open_and_leaves_salts_and_sessions_alone():
    ring = KeyRing.build([], [""])
    assert not ring.enabled and ring.tenant_for(None) is OPEN_TENANT and OPEN_TENANT.operator
    assert OPEN_TENANT.salt("s") == "s" and OPEN_TENANT.salt(None) is None and OPEN_TENANT.session("x") == "x"


def test_namespaces_and_salts_give_disjoint_block_hashes():
    ring = KeyRing.build(["a", "b"])
    a, b = ring.tenant_for("a"), ring.tenant_for("b")
    hashes = {name: set(block_hashes(PROMPT, 16, salt)) for name, salt in
              {"open": None, "a": a.salt(None), "b": b.salt(None), "a+s": a.salt("s"), "open+s": "s"}.items()}
    names = list(hashes)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            assert not hashes[first] & hashes[second], (first, second)
    assert a.session("s1") != b.session("s1") and a.session(None) is None


@pytest.mark.parametrize("content, needle", [
    ("not json", "cannot read"),
    (json.dumps({"keys": []}), "at least one key"),
    (json.dumps({"keys": [{"namespace": "x"}]}), 'non-empty string "key"'),
    (json.dumps({"keys": [{"key": "k", "tenant": "x"}]}), "unknown field"),
    (json.dumps({"keys": [{"key": "k", "namespace": ""}]}), '"namespace" must be'),
    (json.dumps({"keys": [{"key": "k", "operator": "yes"}]}), '"operator" must be'),
    (json.dumps({"keys": [{"key": "k", "namespace": "x"}, {"key": "k", "namespace": "y"}]}), "another namespace"),
])
def test_a_malformed_keys_file_is_a_clear_error(tmp_path, content, needle):
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ServerConfigError, match=needle):
        KeyRing.build([], [], path)


def test_the_presented_key_is_the_bearer_token_else_x_api_key():
    assert presented_key({b"authorization": b"Bearer  k1 "}) == b"k1"
    assert presented_key({b"authorization": b"Basic abc", b"x-api-key": b"k2"}) == b"k2"
    assert presented_key({}) is None
