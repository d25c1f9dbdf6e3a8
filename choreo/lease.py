"""A Redis leader lease with a fencing token: one supervisor acts at a time.

Why a lease and not a Kafka consumer-group assignment: the supervisor's work (the deadline
index) lives in Redis, so the guard must live where the writes land. The lease is a key
``lease:{name}`` holding ``"<owner>|<token>"`` with a TTL; the token comes from a counter
that only grows (``lease:{name}:fence``), so each holder has a token no earlier holder had.

* ``acquire()`` takes a free lease (new token) or renews ours (same token, TTL reset), in
  one script; it never steals a lease that another owner still holds.
* The holder posts its fence in every shard (``lease:{s<n>}:<name>``, ``choreo.keys``) when
  it gets a new token and again when the copies are half way to their TTL (``COPY_TTL_MS``,
  longer than the lease's, so a steady leader does not write 64 keys on every renewal),
  never over a newer token's, and every supervisor write script first checks
  the copy in its delivery's shard ``== fence`` (see ``choreo.supervision``): a script
  touches one hash slot, so it reads the copy beside the state it writes. A new leader
  posts before it writes anything, so a stale leader's write on a shard is either before
  the new leader's first one there or refused. A copy that outlives its holder's lease
  changes nothing: the next holder's token is higher and overwrites it before any write,
  and until then no other holder writes on that shard. A leader that paused (GC, SIGSTOP, a slow network) past its TTL
  and comes back with a stale token loses every write: its late decisions cannot overwrite
  the new leader's, whatever it believes about itself.
* When the leader dies, its key expires after ``ttl_ms`` and the next instance to ask takes
  it: the takeover delay is bounded by TTL + the asking period.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from choreo import keys
from choreo.batch import BatchScript, run_together

_ACQUIRE = """
local current = redis.call('GET', KEYS[1])
if current then
  local owner = string.match(current, '^(.*)|%d+$')
  if owner == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return current
  end
  return false
end
local token = redis.call('INCR', KEYS[2])
local value = ARGV[1] .. '|' .. token
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return value
"""

# KEYS: a shard's copy. ARGV: the fence, its token, TTL ms
_POST = """
local current = redis.call('GET', KEYS[1])
if current and tonumber(string.match(current, '|(%d+)$')) > tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


COPY_TTL_MS = 60_000  # the shards' copies of the fence; posted again at half of it


def lease_key(name: str) -> str:
    return f"lease:{{{name}}}"


def fence_key(name: str) -> str:
    return f"lease:{{{name}}}:fence"


def shard_copy_key(name: str, shard: int) -> str:
    return f"{keys.of_shard('lease', shard)}:{name}"


@dataclass(frozen=True)
class Holder:
    owner: str
    token: int


def parse(value: str) -> Holder:
    owner, _, token = value.rpartition("|")
    return Holder(owner, int(token))


class Lease:
    """One instance's view of the lease ``name``; ``fence`` is what write scripts check."""

    def __init__(self, client: redis.Redis, name: str, owner: str, ttl_ms: int) -> None:
        if "|" in owner:
            raise ValueError("a lease owner may not contain '|'")
        self.client = client
        self.name = name
        self.owner = owner
        self.ttl_ms = ttl_ms
        self.key = lease_key(name)
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)
        self._post = BatchScript(client, "lease_post", _POST)
        self.fence: str | None = None  # "<owner>|<token>" while we believe we hold it
        self.copy_ttl_ms = max(COPY_TTL_MS, ttl_ms)
        self._posted: tuple[str, float] | None = None  # the fence in the copies, and when

    @property
    def token(self) -> int | None:
        return parse(self.fence).token if self.fence else None

    def acquire(self) -> bool:
        """Take the lease if it is free, renew it if it is ours; False if another holds it.

        Call it more often than ``ttl_ms`` (the supervisor does so before every scan), so a
        live leader never lapses; its own writes still re-check the fence on every call.
        """
        value = self._acquire(keys=[self.key, fence_key(self.name)], args=[self.owner, self.ttl_ms])
        self.fence = value.decode() if isinstance(value, bytes) else None
        if self.fence is None:
            self._posted = None  # a store wiped since could hand out the same fence again
        elif self._copies_due(self.fence):
            self._post_copies(self.fence)
        return self.fence is not None

    def _copies_due(self, fence: str) -> bool:
        if self._posted is None or self._posted[0] != fence:
            return True
        return (time.monotonic() - self._posted[1]) * 1000 > self.copy_ttl_ms / 2

    def _post_copies(self, fence: str) -> None:
        posted_at = time.monotonic()
        [posted] = run_together(self.client, [(self._post, [
            ([self.shard_key(shard)], [fence, parse(fence).token, self.copy_ttl_ms])
            for shard in range(keys.SHARDS)])])
        if all(int(answer) == 1 for answer in posted):
            self._posted = (fence, posted_at)
        else:
            # a newer holder posted meanwhile (we paused past the TTL): give the key up
            # too, so the holder of the newest fence, or the next one, may take it
            self.release()

    def shard_key(self, shard: int) -> str:
        """Where the supervisor's scripts on ``shard`` read the fence."""
        return shard_copy_key(self.name, shard)

    def lost(self) -> None:
        """A write script answered "fenced": we are no longer the leader (or a copy was lost
        with a Redis node: the next acquire posts again)."""
        self.fence = None
        self._posted = None

    def release(self) -> None:
        """Give the lease up at once on a clean stop, so the next leader need not wait a TTL."""
        if self.fence:
            self._release(keys=[self.key], args=[self.fence])
            self.fence = None
            self._posted = None


def holder(client: redis.Redis, name: str) -> Holder | None:
    """Who holds the lease now (for operators and tests)."""
    value = client.get(lease_key(name))
    if not value:
        return None
    return parse(value.decode() if isinstance(value, bytes) else str(value))
