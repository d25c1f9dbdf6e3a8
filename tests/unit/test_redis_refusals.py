"""Which Redis errors are Redis refusing a call whatever its input (the batch is read again)
and which are a call failing on its arguments (the handler's input is dead-lettered): the
texts are Redis 7.0's, as redis-py raises them (it strips the code of the replies it names)."""

from __future__ import annotations

from redis.exceptions import (ConnectionError as RedisConnectionError, DataError, InvalidResponse, MasterDownError,
                              NoPermissionError, OutOfMemoryError, ReadOnlyError, ResponseError, SlotNotCoveredError,
                              WatchError)

from choreo.redis_client import refused_by_redis

ON_SCRIPT = " script: 044658f22a0ab4290cb9c69045c4d4363f85d543, on @user_script:1."


def test_a_call_failing_on_its_arguments_is_not_a_refusal() -> None:
    for text in ("user_script:1: Expected value but found invalid token at character 1" + ON_SCRIPT,
                 "Wrong number of args calling Redis command from script" + ON_SCRIPT,
                 "user_script:1: attempt to perform arithmetic on a nil value" + ON_SCRIPT,
                 "WRONGTYPE Operation against a key holding the wrong kind of value" + ON_SCRIPT,
                 "value is not an integer or out of range", "wrong number of arguments for 'hset' command"):
        assert not refused_by_redis(ResponseError(text)), text
    # what redis-py refuses to send (a None, a bool, a dict among the arguments)
    assert not refused_by_redis(DataError("Invalid input of type: 'NoneType'."))
    assert not refused_by_redis(WatchError("Watched variable changed."))
    assert not refused_by_redis(ValueError("not Redis's"))


def test_redis_refusing_whatever_the_input_is_a_refusal() -> None:
    assert refused_by_redis(OutOfMemoryError("command not allowed when used memory > 'maxmemory'." + ON_SCRIPT))
    assert refused_by_redis(NoPermissionError("this user has no permissions to run the 'hset' command" + ON_SCRIPT))
    assert refused_by_redis(ReadOnlyError("You can't write against a read only replica."))
    assert refused_by_redis(MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."))
    assert refused_by_redis(RedisConnectionError("Connection refused"))
    assert refused_by_redis(SlotNotCoveredError("Slot 42 is not covered by the cluster."))  # no RedisError
    assert refused_by_redis(InvalidResponse("Protocol error"))
    assert refused_by_redis(ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently "
                                          "unable to persist to disk." + ON_SCRIPT))
