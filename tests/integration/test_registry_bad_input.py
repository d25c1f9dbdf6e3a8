"""Hostile and broken requests get the real registry's status and error code, never a 500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest

from choreo.config import settings

pytestmark = pytest.mark.integration

CT = {"Content-Type": "application/vnd.schemaregistry.v1+json"}
SCHEMA = json.dumps({"type": "record", "name": "Bad", "namespace": "test.registry",
                     "fields": [{"name": "id", "type": "string"}]})


@pytest.fixture()
def http(stack: None) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=settings().schema_registry_url, timeout=30) as client:
        yield client


@pytest.fixture()
def subject(http: httpx.Client, unique: str) -> str:
    name = f"bad-{unique}-value"
    assert http.post(f"/subjects/{name}/versions", json={"schema": SCHEMA}, headers=CT).status_code == 200
    return name


def expect(answer: httpx.Response, status: int, code: int) -> None:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/vnd.schemaregistry.v1+json")
    body = answer.json()
    assert body["error_code"] == code, body
    assert isinstance(body["message"], str) and "Traceback" not in body["message"]


def test_malformed_bodies(http: httpx.Client, subject: str) -> None:
    path = f"/subjects/{subject}/versions"
    expect(http.post(path, content=b"{not json", headers=CT), 400, 400)
    expect(http.post(path, content=b"[1, 2]", headers=CT), 422, 422)
    expect(http.post(path, content=b"{}", headers=CT), 422, 42201)
    expect(http.post(path, json={"schema": ""}, headers=CT), 422, 42201)
    expect(http.post(path, json={"schema": 42}, headers=CT), 422, 42201)
    expect(http.post(path, json={"schema": "{\"type\": \"record\"}"}, headers=CT), 422, 42201)
    expect(http.post(path, json={"schema": "{\"type\":\"recordz\",\"name\":\"x\"}"}, headers=CT), 422, 42201)
    expect(http.post(path, content=b"[" * 100000 + b"]" * 100000, headers=CT), 400, 400)
    expect(http.post(path, json={"schema": "[" * 5000 + "]" * 5000}, headers=CT), 422, 42201)
    for kind in ("JSON", "PROTOBUF", "XML"):
        answer = http.post(path, json={"schema": "{}", "schemaType": kind}, headers=CT)
        expect(answer, 422, 42201)
        assert "only AVRO" in answer.json()["message"]
    expect(http.post(path, json={"schema": SCHEMA, "references": [{"name": "x", "subject": "y", "version": 1}]},
                     headers=CT), 422, 42201)
    expect(http.post(f"/subjects/{subject}", content=b"{oops", headers=CT), 400, 400)
    expect(http.post(f"/compatibility/subjects/{subject}/versions/latest", json={"schema": "nope"}, headers=CT),
           422, 42201)


def test_content_types_and_sizes(http: httpx.Client, subject: str) -> None:
    path = f"/subjects/{subject}/versions"
    body = json.dumps({"schema": SCHEMA}).encode()
    for accepted in ("application/vnd.schemaregistry.v1+json", "application/vnd.schemaregistry+json",
                     "application/json; charset=utf-8", "application/octet-stream"):
        assert http.post(path, content=body, headers={"Content-Type": accepted}).status_code == 200
    expect(http.post(path, content=body, headers={"Content-Type": "text/plain"}), 415, 415)
    expect(http.post(path, content=body, headers={"Content-Type": "application/x-www-form-urlencoded"}), 415, 415)
    huge = json.dumps({"schema": SCHEMA, "pad": "x" * (2 << 20)}).encode()
    expect(http.post(path, content=huge, headers=CT), 413, 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap must hold while streaming
        for _ in range(40):
            yield b" " * 65536

    expect(http.post(path, content=chunks(), headers=CT), 413, 413)


def test_levels_and_modes(http: httpx.Client, subject: str) -> None:
    expect(http.put(f"/config/{subject}", json={"compatibility": "SIDEWAYS"}, headers=CT), 422, 42203)
    expect(http.put("/config", json={"compatibility": 7}, headers=CT), 422, 42203)
    expect(http.put(f"/config/{subject}", json={}, headers=CT), 422, 42203)
    expect(http.get(f"/config/{subject}"), 404, 40408)
    assert http.get(f"/config/{subject}", params={"defaultToGlobal": "True"}).json()["compatibilityLevel"]
    assert http.put(f"/config/{subject}", json={"compatibility": "full"}, headers=CT).json() == {"compatibility": "FULL"}
    assert http.get(f"/config/{subject}").json()["compatibilityLevel"] == "FULL"
    expect(http.put(f"/mode/{subject}", json={"mode": "READMOSTLY"}, headers=CT), 422, 42204)
    expect(http.get(f"/mode/{subject}"), 404, 40409)
    assert http.put(f"/mode/{subject}", json={"mode": "READONLY"}, headers=CT).json() == {"mode": "READONLY"}
    other = json.dumps({"type": "record", "name": "Bad", "namespace": "test.registry",
                        "fields": [{"name": "id", "type": "string"}, {"name": "x", "type": "int", "default": 0}]})
    expect(http.post(f"/subjects/{subject}/versions", json={"schema": other}, headers=CT), 422, 42205)
    expect(http.delete(f"/subjects/{subject}/versions/1"), 422, 42205)
    assert http.post(f"/subjects/{subject}", json={"schema": SCHEMA}, headers=CT).status_code == 200  # reads work
    expect(http.put(f"/mode/{subject}", json={"mode": "IMPORT"}, headers=CT), 422, 42205)  # not empty
    assert http.delete(f"/mode/{subject}").json() == {"mode": "READONLY"}
    assert http.post(f"/subjects/{subject}/versions", json={"schema": other}, headers=CT).status_code == 200


def test_absurd_versions_and_ids(http: httpx.Client, subject: str, unique: str) -> None:
    for version in ("0", "-2", "abc", "1.5", str(2**31), "99999999999999999999", "latest%00"):
        expect(http.get(f"/subjects/{subject}/versions/{version}"), 422, 42202)
        expect(http.delete(f"/subjects/{subject}/versions/{version}"), 422, 42202)
    expect(http.get(f"/subjects/{subject}/versions/999"), 404, 40402)
    expect(http.get(f"/subjects/nobody-{unique}/versions/1"), 404, 40401)
    expect(http.get(f"/subjects/nobody-{unique}/versions"), 404, 40401)
    expect(http.post(f"/subjects/nobody-{unique}", json={"schema": SCHEMA}, headers=CT), 404, 40401)
    other = json.dumps({"type": "record", "name": "Unseen", "fields": [{"name": "z", "type": "int"}]})
    expect(http.post(f"/subjects/{subject}", json={"schema": other}, headers=CT), 404, 40403)
    for schema_id in ("-1", "0", "2147483647"):
        expect(http.get(f"/schemas/ids/{schema_id}"), 404, 40403)
        expect(http.get(f"/schemas/ids/{schema_id}/versions"), 404, 40403)
    for schema_id in ("abc", "1e3", str(2**40), "%00"):
        expect(http.get(f"/schemas/ids/{schema_id}"), 404, 404)
    expect(http.post(f"/compatibility/subjects/{subject}/versions/77", json={"schema": SCHEMA}, headers=CT),
           404, 40402)
    expect(http.post(f"/compatibility/subjects/nobody-{unique}/versions/1", json={"schema": SCHEMA}, headers=CT),
           404, 40401)
    assert http.post(f"/compatibility/subjects/nobody-{unique}/versions/latest", json={"schema": SCHEMA},
                     headers=CT).json() == {"is_compatible": True}


def test_hostile_subject_names(http: httpx.Client, unique: str) -> None:
    for name in ("a\x00b", "tab\there", "\x1b[31mred", "x" * 5000, "__GLOBAL"):
        expect(http.post(f"/subjects/{quote(name, safe='')}/versions", json={"schema": SCHEMA}, headers=CT), 422, 42208)
        expect(http.get(f"/subjects/{quote(name, safe='')}/versions"), 422, 42208)
    # a subject that looks like a path is just a name: it cannot reach /config or another subject
    tricky = f"../../config/{unique}"
    path = f"/subjects/{quote(tricky, safe='')}/versions"
    assert http.post(path, json={"schema": SCHEMA}, headers=CT).json()["id"] > 0
    assert http.get(path).json() == [1]
    assert tricky in http.get("/subjects").json()
    assert "compatibilityLevel" in http.get("/config").json()
    assert http.delete(f"/subjects/{quote(tricky, safe='')}").json() == [1]
    assert http.delete(f"/subjects/{quote(tricky, safe='')}", params={"permanent": "true"}).json() == [1]
    unicode_name = f"livraison-é-{unique}"
    assert http.post(f"/subjects/{quote(unicode_name, safe='')}/versions", json={"schema": SCHEMA},
                     headers=CT).status_code == 200
    assert unicode_name in http.get("/subjects").json()


def test_delete_sequence_errors(http: httpx.Client, subject: str) -> None:
    expect(http.delete(f"/subjects/{subject}/versions/1", params={"permanent": "true"}), 404, 40407)
    expect(http.delete(f"/subjects/{subject}", params={"permanent": "TRUE"}), 404, 40405)
    assert http.delete(f"/subjects/{subject}/versions/1").json() == 1
    expect(http.delete(f"/subjects/{subject}/versions/1"), 404, 40406)
    expect(http.get(f"/subjects/{subject}/versions/1"), 404, 40401)  # no live version left
    assert http.get(f"/subjects/{subject}/versions/1", params={"deleted": "True"}).json()["version"] == 1
    assert http.post(f"/subjects/{subject}/versions", json={"schema": SCHEMA}, headers=CT).status_code == 200
    assert http.get(f"/subjects/{subject}/versions").json() == [2]  # versions are never reused
    assert http.delete(f"/subjects/{subject}").json() == [2]
    expect(http.delete(f"/subjects/{subject}"), 404, 40404)
    assert subject in http.get("/subjects", params={"deleted": "true"}).json()
    assert subject not in http.get("/subjects").json()
    assert http.delete(f"/subjects/{subject}", params={"permanent": "True"}).json() == [1, 2]
    expect(http.delete(f"/subjects/{subject}"), 404, 40401)


def test_unknown_paths_methods_and_unsupported_features(http: httpx.Client, unique: str) -> None:
    expect(http.get("/nothing/here"), 404, 404)
    expect(http.get("/subjects/a/versions/1/schema/extra"), 404, 404)
    expect(http.patch("/subjects"), 405, 405)
    expect(http.put("/schemas/types"), 405, 405)
    expect(http.get("/schemas/guids/00000000-0000-0000-0000-000000000000"), 404, 404)
    expect(http.get("/dek-registry/v1/keks/k"), 404, 404)
    # what confluent-kafka >= 2.14 asks on every serializer/deserializer first use
    expect(http.get(f"/associations/resources/-/t.{unique}", params={"resourceType": "topic",
                                                                    "associationType": "value"}), 404, 40401)
    assert http.get("/").json() == {}
    assert http.get("/schemas/types").json() == ["AVRO"]
    assert http.get("/contexts").json() == ["."]
    health = http.get("/_health").json()
    assert health["ready"] is True and health["skipped_records"] == 0
