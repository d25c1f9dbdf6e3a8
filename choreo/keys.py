"""Where state lives in Redis: every key a script touches shares one hash slot.

A delivery's keys (its step table, dedupe entries, effect answers, declared records) carry
its *shard's* hash tag, ``{s<n>}``, not its own id: the indexes over many deliveries (the
deadline index, the supervisor's fence) are kept per shard under the same tag, so a step
transition that updates a delivery and its deadline in one script touches one slot, on a
single node as on a Redis Cluster. ``SHARDS`` fixes how many such slots there are: enough to
spread over a cluster's masters (64 over 3 masters: 22/21/21), few enough that the
supervisor walks them all on each scan and a batch of events splits into few calls.

Changing ``SHARDS`` or a key's form moves every delivery's state: it is part of the layout,
named by ``LAYOUT``.
"""

from __future__ import annotations

import zlib

LAYOUT = 3  # the key layout's version
SHARDS = 64


def shard_of(delivery_id: str) -> int:
    """The delivery's shard: stable across processes and versions (CRC-32 of its id)."""
    return zlib.crc32(delivery_id.encode()) % SHARDS


def shard_tag(shard: int) -> str:
    return f"{{s{shard}}}"


def of_delivery(prefix: str, delivery_id: str) -> str:
    """``<prefix>:{s<n>}<delivery id>``: a delivery's own key, in its shard's slot."""
    return f"{prefix}:{shard_tag(shard_of(delivery_id))}{delivery_id}"


def of_shard(prefix: str, shard: int) -> str:
    """``<prefix>:{s<n>}``: a per-shard index, in the slot of its shard's deliveries."""
    return f"{prefix}:{shard_tag(shard)}"


def in_slot_of(key: str, delivery_id: str) -> bool:
    """Whether ``key`` lies in the delivery's slot (carries its shard's tag)."""
    return shard_tag(shard_of(delivery_id)) in key


def tagged(name: str) -> str:
    """``<name>:{<name>}``: a structure of its own slot (a pool, a lease, an admission set),
    whose keys all carry the same tag and so may be used together in one script."""
    return f"{name}:{{{name}}}"
