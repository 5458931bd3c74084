"""The wire protocol of torch.distributed's TCPStore server, as far as this package speaks it.

The wire protocol (torch 2.13; identical for both server backends, libuv and
the legacy one; checked against the installed server by
``tests/test_tcpstore_client.py``):

* Integers are in the host's byte order, which on every platform torch ships
  for is little-endian: sizes and counts are u64, ``add`` operands and
  results i64, the handshake magic and ping nonce u32.
* A string or a byte vector is its u64 length followed by its bytes.
* A request is a one-byte query type followed by its arguments. The client
  prefixes every key with ``/`` (torch's ``TCPStore`` does, so ``"k"`` is
  ``"/k"`` on the wire).
* The connection opens with VALIDATE + the magic ``0x3C85F7CE``, then PING +
  a nonce that the server echoes. A server ignores (libuv) or drops (legacy)
  a connection whose first request is not a valid VALIDATE.
* Replies: GET / COMPARE_SET a vector; ADD, GETNUMKEYS, DELETE_KEY an i64
  (DELETE_KEY: the number of keys removed); CHECK one byte, 0 = ready,
  1 = not ready; MULTI_GET one vector per key. SET, APPEND and MULTI_SET get
  no reply.
* WAIT (u64 count, keys) answers one byte 0 (STOP_WAITING) once every key
  exists, immediately if they do. To give up, the client sends CANCEL_WAIT,
  answered by one byte 1 (WAIT_CANCELED); a STOP_WAITING sent before the
  cancel arrived comes first.
* COMPARE_SET(key, expected, desired): on a missing key, an empty
  ``expected`` creates the key with ``desired`` and returns ``desired``; a
  non-empty ``expected`` creates nothing and returns ``expected``. On an
  existing key, the value is replaced when it equals ``expected``; the reply
  is the value the key holds afterwards.
  torch 2.13's libuv server wakes the waiters of the key when compare_set
  creates it; its legacy server does not (only set, add, append and
  multi_set wake waiters there), whichever client sends the compare_set.
* ADD parses the stored value as a decimal integer (a missing key counts 0),
  stores the sum as decimal text and returns it.
* There are no error replies: a request the server cannot serve (``add`` on
  a value that is not an integer, an unknown query type, and on the libuv
  server a key over 8 KiB, a value over 8 MiB or more than 131,072 keys in
  one request) makes it drop the connection. This client checks the limits
  before sending (they are the default server's) and reports a dropped
  connection as :class:`StoreConnectionError`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

Value = str | bytes | bytearray | memoryview

# Query types of torch's TCPStore server (c10d::detail::QueryType).
VALIDATE = 0
SET = 1
COMPARE_SET = 2
GET = 3
ADD = 4
CHECK = 5
WAIT = 6
GETNUMKEYS = 7
DELETE_KEY = 8
APPEND = 9
MULTI_GET = 10
MULTI_SET = 11
CANCEL_WAIT = 12
PING = 13

VALIDATION_MAGIC = 0x3C85F7CE
CHECK_READY = 0
CHECK_NOT_READY = 1
STOP_WAITING = 0
WAIT_CANCELED = 1

#: torch's TCPStore client prefixes every key with this.
KEY_PREFIX = "/"
#: Limits of the libuv server (torch's default), checked before sending.
MAX_KEY_BYTES = 8 * 1024  # on the wire, KEY_PREFIX included
MAX_VALUE_BYTES = 8 * 1024 * 1024
MAX_KEYS_PER_REQUEST = 128 * 1024

U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
# A str of at most this many characters encodes to at most 4x as many bytes: below MAX_VALUE_BYTES.
_SHORT_STR = MAX_VALUE_BYTES // 4
_COMPARE_SET_BYTE = bytes((COMPARE_SET,))


def encode_key(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"a store key is a str, got {type(key).__name__}")
    raw = (KEY_PREFIX + key).encode()
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"store key of {len(raw)} bytes (with prefix): the server takes at most {MAX_KEY_BYTES}")
    return raw


def encode_value(value: Value) -> bytes:
    if type(value) is str and len(value) <= _SHORT_STR:  # the common case, checked without encoding twice
        return value.encode()
    if isinstance(value, str):
        raw = value.encode()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
    else:
        raise TypeError(f"a store value is str or bytes, got {type(value).__name__}")
    if len(raw) > MAX_VALUE_BYTES:
        raise ValueError(f"store value of {len(raw)} bytes: the server takes at most {MAX_VALUE_BYTES}")
    return raw


def encode_string(raw: bytes) -> bytes:
    return U64.pack(len(raw)) + raw


def encode_key_value(command: int, key: str, value: Value) -> bytes:
    """One request of a key and a value (SET, APPEND)."""
    return bytes((command,)) + encode_string(encode_key(key)) + encode_string(encode_value(value))


def encode_compare_set(key: str, expected: Value, desired: Value) -> bytes:
    """One COMPARE_SET request (a node agent sends a node's seats as a batch of these)."""
    k, e, d = encode_key(key), encode_value(expected), encode_value(desired)
    return b"".join((_COMPARE_SET_BYTE, U64.pack(len(k)), k, U64.pack(len(e)), e, U64.pack(len(d)), d))


def encode_key_list(keys: Iterable[str], what: str) -> tuple[list[str], bytes]:
    if isinstance(keys, str):
        raise TypeError(f"{what} takes a list of keys, got the str {keys!r}")
    keys = list(keys)
    if len(keys) > MAX_KEYS_PER_REQUEST:
        raise ValueError(f"{what} of {len(keys)} keys: the server takes at most {MAX_KEYS_PER_REQUEST}")
    return keys, U64.pack(len(keys)) + b"".join(encode_string(encode_key(k)) for k in keys)
