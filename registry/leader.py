"""Who writes: a Redis lease with a fencing token, backed by Kafka's own producer fencing.

Why two mechanisms. The lease answers the *routing* question (which instance takes writes,
and at which URL followers forward them) quickly and observably: the key
``registry:leader:<topic>`` holds ``{"id", "url", "token"}`` with a TTL the holder renews.
A lease alone is not safe, though: a leader paused past its TTL (GC, SIGSTOP, a slow
disk) still believes it leads when it wakes, and Kafka cannot check a Redis token. The
*safety* half is therefore Kafka's: all instances share one ``transactional.id``, so the
new leader's first ``init_transactions`` fences the old producer at the broker and the old
leader's next commit fails (see ``store.py``). The lease token grows with each acquisition
and is logged with every write, so a log line always tells which term wrote.

A leader also stops writing by itself once its local lease deadline (measured on the
monotonic clock, minus a safety margin) passes without a successful renewal.

With a peer secret (``registry.auth.Peers``) the lease also carries ``sig``, an HMAC of the
holder's id and URL: a lease without a valid one (planted by whoever can write that key) is
never followed, and an eligible instance removes it and takes the lease.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import redis

from choreo.logs import get_logger
from choreo.redis_client import connect
from registry.auth import Peers

log = get_logger(component="registry.leader")

_ACQUIRE = """
if redis.call('exists', KEYS[1]) == 1 then return 0 end
local token = redis.call('incr', KEYS[2])
local value = cjson.encode({id=ARGV[1], url=ARGV[2], token=token, sig=ARGV[4]})
redis.call('set', KEYS[1], value, 'PX', ARGV[3])
return token
"""

_RENEW = """
local value = redis.call('get', KEYS[1])
if not value then return 0 end
local lease = cjson.decode(value)
if lease.id ~= ARGV[1] or tostring(lease.token) ~= ARGV[2] then return 0 end
return redis.call('pexpire', KEYS[1], ARGV[3])
"""

_EVICT = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""

_RELEASE = """
local value = redis.call('get', KEYS[1])
if not value then return 0 end
local lease = cjson.decode(value)
if lease.id ~= ARGV[1] then return 0 end
return redis.call('del', KEYS[1])
"""


@dataclass(frozen=True)
class Lease:
    instance_id: str
    url: str
    token: int
    signature: str = ""


LEASE_PREFIX = "registry:leader:"  # the only keys the registry keeps in Redis


def is_lease_key(name: bytes) -> bool:
    """Whether a key of the shared Redis is the registry's (its lease or term counter), not
    the pipeline's: a walk of the pipeline's keys leaves these out."""
    return name.startswith(LEASE_PREFIX.encode())


def lease_key(topic: str) -> str:
    """``registry:leader:{<topic>}``: the lease and its term counter (``:token``) share a
    hash slot, since one script takes both (on a Redis Cluster too)."""
    return f"{LEASE_PREFIX}{{{topic}}}"


class LeaderElection:
    """Keeps trying to hold the lease (when eligible) and tells who holds it."""

    def __init__(self, redis_url: str, topic: str, instance_id: str, url: str,
                 ttl_ms: int = 6000, eligible: bool = True, peers: Peers | None = None) -> None:
        self.redis_url = redis_url
        self._client: redis.Redis | None = None
        self.key = lease_key(topic)
        self.token_key = f"{self.key}:token"
        self.instance_id = instance_id
        self.url = url
        self.ttl_ms = ttl_ms
        self.eligible = eligible
        self.peers = peers
        self._signature = peers.sign_lease(instance_id, url) if peers else ""
        self._token = 0
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def client(self) -> redis.Redis:
        """Connected on first use, so a Redis that is away when the registry starts only
        delays the election (``connect`` asks the server whether it is a cluster node)."""
        if self._client is None:
            self._client = connect(self.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        return self._client

    # -- the loop -----------------------------------------------------------------------

    def start(self) -> None:
        self.tick()
        self._thread = threading.Thread(target=self._run, name="registry-leader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self.is_leader():
            try:
                self.client.eval(_RELEASE, 1, self.key, self.instance_id)
            except redis.RedisError:
                pass
        self._valid_until = 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            self.tick()

    def tick(self) -> None:
        """One renewal or acquisition attempt; never raises (Redis may be briefly away)."""
        if not self.eligible:
            return
        started = time.monotonic()
        try:
            if self._token and self.client.eval(_RENEW, 1, self.key, self.instance_id, str(self._token), str(self.ttl_ms)):
                self._valid_until = started + self.ttl_ms / 1000 * 0.8
                return
            was_leader = self._token != 0
            self._token = 0
            self._valid_until = 0.0
            if was_leader:
                log.warning("leadership_lost", instance=self.instance_id)
            self._evict_untrusted()
            token = int(self.client.eval(_ACQUIRE, 2, self.key, self.token_key, self.instance_id, self.url,
                                         str(self.ttl_ms), self._signature))
            if token:
                self._token = token
                self._valid_until = started + self.ttl_ms / 1000 * 0.8
                log.info("leadership_acquired", instance=self.instance_id, term=token, url=self.url)
        except redis.RedisError as exc:
            log.warning("lease_unreachable", error=str(exc))
        except Exception:  # whatever the lease holds: the election goes on, it is tried again next tick
            log.exception("lease_tick_failed")

    def _evict_untrusted(self) -> None:
        raw = self.client.get(self.key)
        lease = _parse(raw)
        if raw is not None and (lease is None or not self.trusted(lease)):
            log.warning("untrusted_lease_removed")
            self.client.eval(_EVICT, 1, self.key, raw)

    # -- questions ----------------------------------------------------------------------

    def trusted(self, lease: Lease) -> bool:
        """Whether the lease was written by an instance holding the peer secret (always,
        without one)."""
        return self.peers is None or self.peers.lease_ok(lease.instance_id, lease.url, lease.signature)

    def is_leader(self) -> bool:
        return self._token != 0 and time.monotonic() < self._valid_until

    @property
    def token(self) -> int:
        return self._token if self.is_leader() else 0

    def current(self) -> Lease | None:
        """The lease as Redis holds it now (None: nobody leads, or Redis cannot say)."""
        try:
            raw = self.client.get(self.key)
        except redis.RedisError:
            return None
        return _parse(raw)


def _parse(raw: bytes | str | None) -> Lease | None:
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        return Lease(str(data["id"]), str(data["url"]), int(data["token"]), str(data.get("sig", "")))
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):  # a token of 1e400: inf
        return None
