"""The codec contract under fuzzing: any input decodes to a message or raises
``ProtocolError`` — never KeyError, TypeError, IndexError, ValueError, a msgpack error,
RecursionError or anything else. A session fed any decoded sequence never raises either.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pkv.errors import ProtocolError
from p2pkv.identity import RunConfig
from p2pkv.protocol import (
    Geometry,
    Hello,
    KeyHash,
    Output,
    Role,
    Session,
    decode,
    decode_head,
    encode,
)
from p2pkv.protocol.session import LocalProtocolError

FUZZ = settings(max_examples=2000, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

VECTORS = Path(__file__).resolve().parent.parent / "protocol" / "vectors"
VALID = [
    [bytes.fromhex(f) for f in v["frames"]]
    for v in json.loads((VECTORS / "messages.json").read_text())["vectors"]
]
TAGS = ["hello", "welcome", "refuse", "lookup", "hits", "fetch", "credit", "block", "done",
        "abort", "abort_ack", "ping", "pong", "bye", "error", "nope"]

scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=70)
    | st.sampled_from(TAGS)
)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8) | st.sampled_from(
        ["t", "v", "req", "keys", "idx", "sums", "rc", "geo", "seg", "bpb", "pk"]), children,
        max_size=5),
    max_leaves=30,
)
segments = st.none() | st.lists(st.integers(min_value=1, max_value=16), min_size=1, max_size=3)


def check(frames: list[Any], segs: list[int] | None = None) -> None:
    try:
        msg = decode(frames, segs)
    except ProtocolError as exc:
        assert isinstance(exc.code, int) and 100 <= exc.code < 400
        return
    # A decoded message re-encodes and decodes to an equal message.
    again = decode([bytes(f) for f in encode(msg)], segs)
    assert again == msg


@FUZZ
@given(st.lists(st.binary(max_size=120), max_size=4), segments)
def test_random_frames(frames: list[bytes], segs: list[int] | None) -> None:
    check(frames, segs)


@FUZZ
@given(values, st.lists(st.binary(max_size=16), max_size=3), segments)
def test_random_msgpack_values(value: Any, extra: list[bytes], segs: list[int] | None) -> None:
    check([msgpack.packb(value, use_bin_type=True), *extra], segs)


@FUZZ
@given(st.sampled_from(VALID), st.data())
def test_mutated_valid_messages(frames: list[bytes], data: st.DataObject) -> None:
    head = msgpack.unpackb(frames[0], raw=False)
    op = data.draw(st.sampled_from(["drop", "replace", "add", "retag", "nest"]))
    key = data.draw(st.sampled_from(sorted(head)))
    if op == "drop":
        del head[key]
    elif op == "replace":
        head[key] = data.draw(values)
    elif op == "add":
        head[data.draw(st.text(max_size=6))] = data.draw(values)
    elif op == "retag":
        head["t"] = data.draw(st.sampled_from(TAGS))
    elif isinstance(head[key], dict) and head[key]:
        inner = data.draw(st.sampled_from(sorted(head[key])))
        head[key][inner] = data.draw(values)
    elif isinstance(head[key], list) and head[key]:
        head[key][data.draw(st.integers(0, len(head[key]) - 1))] = data.draw(values)
    payload = data.draw(st.sampled_from([frames[1:], [], frames[1:2], [b"x"] * 3]))
    check([msgpack.packb(head, use_bin_type=True), *payload],
          data.draw(st.sampled_from([None, [8, 4], [1]])))


@FUZZ
@given(st.sampled_from(VALID), st.data())
def test_truncated_and_flipped_frames(frames: list[bytes], data: st.DataObject) -> None:
    head = bytearray(frames[0])
    cut = data.draw(st.integers(0, len(head)))
    flips = data.draw(st.lists(st.tuples(st.integers(0, max(len(head) - 1, 0)),
                                         st.integers(0, 255)), max_size=3))
    for pos, byte in flips:
        if pos < len(head):
            head[pos] = byte
    del head[cut:]
    check([bytes(head), *frames[1:]])
    with contextlib.suppress(ProtocolError):
        decode_head(memoryview(bytes(head)), None)


def test_deeply_nested_frame_is_malformed_not_recursion_error() -> None:
    for depth in (100, 10_000, 100_000):
        check([b"\x91" * depth + b"\x01"])
        check([b"\x81\xa1t" * depth + b"\x01"])


def test_non_bytes_inputs_are_protocol_errors() -> None:
    for frames in ([None], [1], ["text"], [b"\x80", None], 5, None):
        try:
            decode(frames)  # type: ignore[arg-type]
        except ProtocolError:
            continue
        raise AssertionError(f"{frames!r} decoded")


CFG = RunConfig("m", parallel_agnostic=True)
LOCAL = Hello.for_config("me", CFG, Geometry.of([8, 4]), KeyHash("xxh3-128", 0))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([Role.CLIENT, Role.SERVER]),
       st.lists(st.sampled_from(VALID) | st.lists(st.binary(max_size=40), max_size=2),
                max_size=12),
       st.lists(st.sampled_from(["lookup", "fetch", "poll", "close"]), max_size=4))
def test_session_never_raises_on_peer_input(role: Role, inputs: list[list[bytes]],
                                            calls: list[str]) -> None:
    session = Session(role, LOCAL, now=0.0)
    session.start(0.0)
    now = 0.0
    for frames, call in zip(inputs, calls + [""] * len(inputs), strict=False):
        now += 0.5
        out = session.receive_frames(frames, now)
        assert isinstance(out, Output)
        for reply in out.replies:
            decode_head(encode(reply)[0])
        try:
            if call == "lookup":
                session.lookup([b"k"], now)
            elif call == "fetch":
                session.fetch([b"k"], 1, now)
        except LocalProtocolError:
            pass
        if call == "poll":
            assert isinstance(session.poll(now + 100.0), Output)
        elif call == "close":
            session.close()
