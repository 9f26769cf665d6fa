"""Request and answer signing, and the admission proof (pipeline.cluster.auth)."""
from __future__ import annotations

import pytest

from pipeline.cluster import auth
from pipeline.cluster.membership import _malformed
from pipeline.errors import AuthError

KEY = b"k" * 32


def headers_of(h: dict[str, str]) -> dict[str, str | None]:
    return {name: h.get(name) for name in auth.SIGNED_HEADERS}


def test_a_request_is_good_only_at_the_node_it_names():
    h = headers_of(auth.sign(KEY, "DELETE", "/v1/shards/x", node="w-a"))
    assert auth.check(KEY, "DELETE", "/v1/shards/x", h, 300, node_id="w-a") == auth.NO_BODY
    with pytest.raises(AuthError, match="meant for storage worker 'w-a'"):
        auth.check(KEY, "DELETE", "/v1/shards/x", h, 300, node_id="w-b")
    forged = dict(h, **{auth.NODE_HEADER: "w-b"})  # renaming the target breaks the signature
    with pytest.raises(AuthError, match="signature does not match"):
        auth.check(KEY, "DELETE", "/v1/shards/x", forged, 300, node_id="w-b")


def test_any_node_is_accepted_only_where_the_worker_allows_it():
    h = headers_of(auth.sign(KEY, "GET", "/v1/status"))
    assert h[auth.NODE_HEADER] == auth.ANY_NODE
    auth.check(KEY, "GET", "/v1/status", h, 300, node_id="w-a", any_node=True)
    with pytest.raises(AuthError, match="meant for"):
        auth.check(KEY, "GET", "/v1/status", h, 300, node_id="w-a")


def test_an_answer_is_bound_to_its_signer_its_request_status_and_body():
    body = b'{"created": true}'
    signed = dict(auth.sign_response(KEY, "w-a", "rid1", 201, auth.body_digest(body)))
    assert auth.check_response(KEY, "rid1", 201, signed.get, body, node_id="w-a") == "w-a"
    for rid, status, got, node, why in (("rid2", 201, body, "w-a", "signature"),  # another request's answer
                                        ("rid1", 200, body, "w-a", "signature"),  # another status
                                        ("rid1", 201, b'{"created": false}', "w-a", "body"),
                                        ("rid1", 201, body, "w-b", "not by w-b")):
        with pytest.raises(AuthError, match=why):
            auth.check_response(KEY, rid, status, signed.get, got, node_id=node)
    with pytest.raises(AuthError, match="not signed"):
        auth.check_response(KEY, "rid1", 201, {}.get, body, node_id="w-a")
    with pytest.raises(AuthError, match="signature"):
        auth.check_response(b"another key", "rid1", 201, signed.get, body, node_id="w-a")
    stream = dict(auth.sign_response(KEY, "w-a", "rid3", 200, auth.NO_BODY, "1048576"))
    assert auth.check_response(KEY, "rid3", 200, stream.get, None, node_id="w-a", length="1048576") == "w-a"
    with pytest.raises(AuthError, match="signature"):  # a HEAD that lies about the size
        auth.check_response(KEY, "rid3", 200, stream.get, None, node_id="w-a", length="1", head=True)


def test_the_proof_binds_the_url_dialled_and_survives_garbage():
    p = auth.proof(KEY, "w-a", "http://10.0.0.5:7100", "n1")
    assert auth.check_proof(KEY, "w-a", "http://10.0.0.5:7100", "n1", p)
    assert not auth.check_proof(KEY, "w-a", "http://10.0.0.66:7100", "n1", p)  # relayed: another URL
    for garbage in ("\u00e9" * 64, None, 12, ["x"], ""):
        assert not auth.check_proof(KEY, "w-a", "http://10.0.0.5:7100", "n1", garbage)


@pytest.mark.parametrize("doc,problem", [
    ({"capacity": 1, "free": 1}, None),
    ({"capacity": "lots", "free": 1}, "capacity"),
    ({"capacity": 1, "free": -1}, "free"),
    ({"capacity": True, "free": 1}, "capacity"),
    ({"capacity": 1, "free": 1, "used": 1.5}, "used"),
    ({"capacity": 1, "free": 1, "zone": ["a"]}, "zone"),
])
def test_a_malformed_status_is_named(doc, problem):
    found = _malformed(doc)
    assert (found is None) if problem is None else (problem in found)
