"""A producer that writes what the protocol allows and confluent-kafka's Python API does
not: header names of any bytes (it takes ``str`` names only, and writes them as UTF-8).
It calls the librdkafka that confluent-kafka ships (``rd_kafka_produceva``), so the record
reaches the broker exactly as another client's could."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import confluent_kafka

from choreo.config import settings

_TOPIC, _VALUE, _KEY, _MSGFLAGS, _HEADER = 1, 4, 5, 7, 9  # rd_kafka_vtype_t
_COPY = 0x2  # RD_KAFKA_MSG_F_COPY: librdkafka copies key and value before produceva returns
_PRODUCER = 0  # rd_kafka_type_t


class _Mem(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("size", ctypes.c_size_t)]


class _Header(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_void_p), ("size", ctypes.c_ssize_t)]


class _Value(ctypes.Union):
    _fields_ = [("cstr", ctypes.c_char_p), ("i", ctypes.c_int), ("mem", _Mem), ("header", _Header),
                ("pad", ctypes.c_char * 64)]


class _Vu(ctypes.Structure):  # rd_kafka_vu_t
    _fields_ = [("vtype", ctypes.c_int), ("u", _Value)]


def _library() -> ctypes.CDLL:
    libs = Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs"
    lib = ctypes.CDLL(str(next(libs.glob("librdkafka*.so*"))))
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                      ctypes.c_size_t]
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_produceva.restype = ctypes.c_void_p
    lib.rd_kafka_produceva.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.rd_kafka_flush.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_outq_len.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
    return lib


def _bytes(data: bytes) -> _Mem:
    return _Mem(ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p), len(data))


RawRecord = tuple[str, bytes, bytes, Sequence[tuple[bytes, bytes]]]  # topic, key, value, headers


def produce_raw(records: Sequence[RawRecord]) -> None:
    """Each record to its topic, each header name any bytes but NUL; every record
    acknowledged by all replicas, or AssertionError."""
    lib = _library()
    conf = lib.rd_kafka_conf_new()
    error = ctypes.create_string_buffer(512)
    for name, value in (("bootstrap.servers", settings().kafka_bootstrap_servers), ("acks", "all")):
        assert lib.rd_kafka_conf_set(conf, name.encode(), value.encode(), error, 512) == 0, error.value
    handle = lib.rd_kafka_new(_PRODUCER, conf, error, 512)
    assert handle, error.value
    try:
        for topic, key, value, headers in records:
            assert all(b"\0" not in name for name, _ in headers)
            vus = (_Vu * (4 + len(headers)))()
            vus[0].vtype, vus[0].u.cstr = _TOPIC, topic.encode()
            vus[1].vtype, vus[1].u.mem = _KEY, _bytes(key)
            vus[2].vtype, vus[2].u.mem = _VALUE, _bytes(value)
            vus[3].vtype, vus[3].u.i = _MSGFLAGS, _COPY
            for i, (name, raw) in enumerate(headers, start=4):
                vus[i].vtype = _HEADER
                vus[i].u.header = _Header(name, ctypes.cast(ctypes.c_char_p(raw), ctypes.c_void_p), len(raw))
            assert not lib.rd_kafka_produceva(handle, vus, len(vus)), "the producer refused a record"
        lib.rd_kafka_flush(handle, 60_000)
        assert lib.rd_kafka_outq_len(handle) == 0, "records not acknowledged in time"
    finally:
        lib.rd_kafka_destroy(handle)
