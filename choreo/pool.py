"""A pool of members with a capacity (drones, couriers, slots), reserved one per holder.

A reservation and a release are each one atomic script, so no member is held by two holders
at once, whatever the concurrency; asking twice for the same holder returns the same member.
Every change is appended to a bounded history stream, so "no member was ever held twice"
can be checked after the fact and not only in the final state.

A pool's keys share one hash slot of their own (``<name>:{<name>}:*``), apart from the
deliveries that hold its members: its operations run as effects on another slot
(``choreo.effects``), which its scripts allow, since asking twice for one holder answers
the same member.

Declared on a service (``service.pool(...)``) with the events that prove a hold and a
release, so ``rebuild-state`` restores the holds from Kafka without knowing the service.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from choreo import keys as layout
from choreo.effects import OnceEffect, Op
from choreo.events import Event

NO_FIT = "NO_FIT"  # no member of the pool could ever take the load: a permanent refusal
HISTORY_MAX = 1_000_000  # ~250 MB bound instead of growth with every reservation ever made

# KEYS: free (zset by capacity), held (member -> holder), booking (holder -> member), history,
# capacity (member -> capacity), max capacity. ARGV: holder, load
_RESERVE = OnceEffect("pool_reserve", """
local holder, load = ARGV[1], tonumber(ARGV[2])
local booked = redis.call('HGET', KEYS[3], holder)
if booked then return booked end
local found = redis.call('ZRANGEBYSCORE', KEYS[1], load, '+inf', 'LIMIT', 0, 1)
if #found == 0 then
  if tonumber(redis.call('GET', KEYS[6]) or '0') < load then return '%(no_fit)s' end
  return false
end
local member = found[1]
redis.call('ZREM', KEYS[1], member)
redis.call('HSET', KEYS[2], member, holder)
redis.call('HSET', KEYS[3], holder, member)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', '%(history)d', '*', 'action', 'reserve', 'drone', member, 'delivery', holder)
return member
""" % {"no_fit": NO_FIT, "history": HISTORY_MAX})

# a holder's member back to the free set; the member, or '' when the holder held none
GIVE_BACK = """
local function give_back(free, held, booking, history, capacity, holder, action)
  local member = redis.call('HGET', booking, holder)
  if not member then return '' end
  redis.call('HDEL', booking, holder)
  if redis.call('HGET', held, member) == holder then
    redis.call('HDEL', held, member)
    redis.call('ZADD', free, redis.call('HGET', capacity, member), member)
  end
  redis.call('XADD', history, 'MAXLEN', '~', '%(history)d', '*', 'action', action, 'drone', member, 'delivery', holder)
  return member
end
""" % {"history": HISTORY_MAX}

# ARGV: holder, the action's name in the history
_RELEASE = OnceEffect("pool_release", GIVE_BACK + """
return give_back(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[2])
""")

# the rebuild's restore of one hold: never takes a member someone else holds. ARGV: holder, member
_RESTORE = """
local holder, member = ARGV[1], ARGV[2]
if redis.call('HGET', KEYS[3], holder) then return 'exists' end
local other = redis.call('HGET', KEYS[2], member)
if other and other ~= holder then return 'conflict:' .. other end
redis.call('ZREM', KEYS[1], member)
redis.call('HSET', KEYS[2], member, holder)
redis.call('HSET', KEYS[3], holder, member)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', '%(history)d', '*', 'action', 'reserve', 'drone', member, 'delivery', holder, 'rebuilt', '1')
return 'restored'
""" % {"history": HISTORY_MAX}

History = list[tuple[bytes, dict[bytes, bytes]]]


@dataclass(frozen=True)
class Reservation:
    """A reservation's answer: the member held, or why none is (``fits``: whether waiting
    can help, i.e. some member could take the load once free)."""

    member: str | None
    fits: bool = True


@dataclass(frozen=True)
class Freed:
    """An event that ends a hold: once published (``when_consumed=False``) or once the pool's
    service has committed past it (it frees the member when it reads it)."""

    model: type[Event]
    when_consumed: bool


@dataclass
class Pool:
    """Members named by ``seed`` (member -> capacity), grown at each start, never shrunk.

    ``returned_on_success``: the holders are deliveries, and a delivery's member comes back
    when the supervisor records its success event (``choreo.supervisor.on_shipped``), in the
    same script on one node: no service of the workflow reads that event to give it back.
    """

    name: str
    seed: Callable[[], Mapping[str, float]]
    returned_on_success: bool = False
    held_by: tuple[type[Event], Callable[[Any], str]] | None = None  # event, its member
    freed: list[Freed] = field(default_factory=list)

    @property
    def free_key(self) -> str:
        return f"{layout.tagged(self.name)}:free"

    @property
    def held_key(self) -> str:
        return f"{layout.tagged(self.name)}:held"

    @property
    def booking_key(self) -> str:
        return f"{layout.tagged(self.name)}:booking"

    @property
    def history_key(self) -> str:
        return f"{layout.tagged(self.name)}:history"

    @property
    def capacity_key(self) -> str:
        return f"{layout.tagged(self.name)}:capacity"

    @property
    def give_back_keys(self) -> tuple[str, ...]:
        """The keys ``GIVE_BACK`` takes, in its order."""
        return self.keys[:5]

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.free_key, self.held_key, self.booking_key, self.history_key, self.capacity_key,
                f"{layout.tagged(self.name)}:max_capacity")

    def reserve(self, holder: str, load: float) -> Op[Reservation]:
        """The smallest free member whose capacity takes ``load``, held for ``holder``."""
        return Op(_RESERVE, self.keys, (holder, load), _reservation)

    def release(self, holder: str, action: str = "release") -> Op[str | None]:
        """Free ``holder``'s member (``action`` names it in the history); the member, or
        ``None`` when the holder held none."""
        return Op(_RELEASE, self.keys, (holder, action), lambda raw: raw or None)

    def rebuilt_from(self, held_by: type[Event], member: Callable[[Any], str],
                     freed_by: Mapping[type[Event], bool]) -> None:
        """Declare the events that prove a hold (and its member) and those that end one
        (event -> ``when_consumed``), for ``rebuild-state``."""
        self.held_by = (held_by, member)
        self.freed = [Freed(model, consumed) for model, consumed in freed_by.items()]

    def grow(self, client: redis.Redis) -> int:
        """Add the members ``seed`` names that are missing (several instances may grow it at
        once: existing members are never touched); the pool's size."""
        members = self.seed()
        existing = int(client.hlen(self.capacity_key))
        if existing >= len(members):
            return existing
        pipe = client.pipeline(transaction=True)
        for member, capacity in members.items():
            pipe.hsetnx(self.capacity_key, member, capacity)
            pipe.zadd(self.free_key, {member: capacity}, nx=True)
        pipe.set(self.keys[5], max(members.values()))
        pipe.execute()
        return len(members)

    def restore(self, client: redis.Redis, holder: str, member: str) -> str:
        """Hold ``member`` for ``holder`` again after Redis was lost: ``restored``, ``exists``
        or ``conflict:<holder>`` (someone else holds it)."""
        answer = client.eval(_RESTORE, len(self.keys), *self.keys, holder, member)
        return answer.decode() if isinstance(answer, bytes) else str(answer)

    def history(self, client: redis.Redis) -> History:
        """The whole history stream, read in pages."""
        entries: History = []
        last = "-"
        while True:
            page: list[Any] = client.xrange(self.history_key, min=last, count=10_000) or []
            if last != "-":
                page = page[1:]
            if not page:
                return entries
            entries.extend(page)
            last = page[-1][0].decode()

    def double_bookings(self, client: redis.Redis) -> list[str]:
        """No member was ever held by two holders at once, checked over its whole history."""
        return violations_in(self.history(client))[0]


def violations_in(entries: History, holding: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """Replay a pool's history from ``holding`` (member -> holder; empty by default): every
    moment a member was reserved while held is a violation. Returns them and who holds what
    at the end."""
    holder = dict(holding or {})
    found: list[str] = []
    for _, fields in entries:
        action = fields[b"action"].decode()
        member, who = fields[b"drone"].decode(), fields[b"delivery"].decode()
        if action == "reserve":
            if holder.get(member, who) != who:
                found.append(f"{member} reserved for {who} while held by {holder[member]}")
            holder[member] = who
        elif holder.get(member) == who:
            del holder[member]
    return found, holder


def _reservation(raw: str | None) -> Reservation:
    if raw == NO_FIT:
        return Reservation(None, fits=False)
    return Reservation(raw or None)
