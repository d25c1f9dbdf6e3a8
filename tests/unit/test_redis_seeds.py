"""``REDIS_URL`` may name several seed nodes of a cluster; each becomes a URL of its own with
the credentials, database and options kept."""

from __future__ import annotations

from choreo.redis_client import seeds


def test_one_host_is_left_as_it_is() -> None:
    assert seeds("redis://127.0.0.1:6379/0") == ["redis://127.0.0.1:6379/0"]
    assert seeds("unix:///run/redis.sock") == ["unix:///run/redis.sock"]


def test_each_seed_keeps_the_login_database_and_options() -> None:
    assert seeds("rediss://svc:secret@a:7000,b:7001/0?ssl_cert_reqs=required") == [
        "rediss://svc:secret@a:7000/0?ssl_cert_reqs=required",
        "rediss://svc:secret@b:7001/0?ssl_cert_reqs=required"]
    assert seeds("redis://a:1,,b:2") == ["redis://a:1", "redis://b:2"]
    assert seeds("rediss://u:p@h1:1,h2:2?ssl_ca_certs=/ca.pem") == [  # options without a database
        "rediss://u:p@h1:1?ssl_ca_certs=/ca.pem", "rediss://u:p@h2:2?ssl_ca_certs=/ca.pem"]
