"""The drone fleet in Redis: who is free, who holds which delivery, and the history of both.

A reservation and a release are each one Lua script, so no drone can be booked for two
deliveries at once, whatever the concurrency. Every change is appended to the
``fleet:history`` stream, so "no drone was ever held twice" can be checked after the fact
and not only in the final state.
"""

from __future__ import annotations

from typing import Any

import redis

from choreo.effects import OnceEffect

FREE = "fleet:free"  # sorted set: free drones scored by capacity (kg)
HELD = "fleet:held"  # hash: drone -> delivery
BOOKING = "fleet:booking"  # hash: delivery -> drone
HISTORY = "fleet:history"  # stream of reserve / release / return (the last ~HISTORY_MAX entries)
HISTORY_MAX = 1_000_000  # ~250 MB bound instead of growth with every delivery ever made
CAPACITY = "fleet:capacity"  # hash: drone -> capacity (kg)
MAX_CAPACITY = "fleet:max_capacity"
KEYS = [FREE, HELD, BOOKING, HISTORY, CAPACITY, MAX_CAPACITY]
CAPACITIES_KG = (2.0, 5.0, 10.0, 25.0)

NO_FIT = "NO_DRONE_FITS"

RESERVE = OnceEffect("reserve_drone", """
local delivery, weight = ARGV[1], tonumber(ARGV[2])
local booked = redis.call('HGET', KEYS[3], delivery)
if booked then return booked end
local found = redis.call('ZRANGEBYSCORE', KEYS[1], weight, '+inf', 'LIMIT', 0, 1)
if #found == 0 then
  if tonumber(redis.call('GET', KEYS[6]) or '0') < weight then return 'NO_DRONE_FITS' end
  return false
end
local drone = found[1]
redis.call('ZREM', KEYS[1], drone)
redis.call('HSET', KEYS[2], drone, delivery)
redis.call('HSET', KEYS[3], delivery, drone)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', '1000000', '*', 'action', 'reserve', 'drone', drone, 'delivery', delivery)
return drone
""")

RELEASE = OnceEffect("release_drone", """
local delivery, action = ARGV[1], ARGV[2]
local drone = redis.call('HGET', KEYS[3], delivery)
if not drone then return '' end
redis.call('HDEL', KEYS[3], delivery)
if redis.call('HGET', KEYS[2], drone) == delivery then
  redis.call('HDEL', KEYS[2], drone)
  redis.call('ZADD', KEYS[1], redis.call('HGET', KEYS[5], drone), drone)
end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', '1000000', '*', 'action', action, 'drone', drone, 'delivery', delivery)
return drone
""")


def seed(client: redis.Redis, size: int) -> int:
    """Grow the fleet to ``size`` drones (never shrinks it, never touches existing drones:
    several instances may seed at once); returns the fleet's size."""
    existing = int(client.hlen(CAPACITY))
    if existing >= size:
        return existing
    pipe = client.pipeline(transaction=True)
    for n in range(existing, size):
        capacity = CAPACITIES_KG[n % len(CAPACITIES_KG)]
        drone = f"drone-{n:05d}"
        pipe.hsetnx(CAPACITY, drone, capacity)
        pipe.zadd(FREE, {drone: capacity}, nx=True)
    pipe.set(MAX_CAPACITY, max(CAPACITIES_KG))
    pipe.execute()
    return size


def history(client: redis.Redis) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The whole ``fleet:history`` stream, read in pages."""
    entries: list[tuple[bytes, dict[bytes, bytes]]] = []
    last = "-"
    while True:
        page: list[Any] = client.xrange(HISTORY, min=last, count=10_000) or []
        if last != "-":
            page = page[1:]
        if not page:
            return entries
        entries.extend(page)
        last = page[-1][0].decode()


def violations_in(entries: list[tuple[bytes, dict[bytes, bytes]]],
                  holding: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """Replay a fleet history from ``holding`` (drone -> delivery; empty by default): every
    moment a drone was reserved while held is a violation. Returns them and who holds what
    at the end."""
    holder = dict(holding or {})
    found: list[str] = []
    for _, fields in entries:
        action = fields[b"action"].decode()
        drone, delivery = fields[b"drone"].decode(), fields[b"delivery"].decode()
        if action == "reserve":
            if holder.get(drone, delivery) != delivery:
                found.append(f"{drone} reserved for {delivery} while held by {holder[drone]}")
            holder[drone] = delivery
        elif holder.get(drone) == delivery:
            del holder[drone]
    return found, holder


def double_bookings(client: redis.Redis) -> list[str]:
    """No drone was ever held by two deliveries at once, checked over its whole history."""
    return violations_in(history(client))[0]
