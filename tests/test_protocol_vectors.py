"""Golden vectors (``protocol/vectors``): committed frames decode to committed messages
(those of messages.json and errors.json, and the capabilities' own files).

The vectors are produced by ``protocol/vectors/gen.py`` from hand-written wire maps, not
by the codec, so these tests cross-check the decoder (and the encoder, by re-encoding).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from p2pkv.errors import ProtocolError
from p2pkv.identity import ABSENT, IdentityExtension
from p2pkv.protocol import Code, Geometry, KeyHash, Message, Reason, decode, encode

VECTORS = Path(__file__).resolve().parent.parent / "protocol" / "vectors"
MESSAGES = json.loads((VECTORS / "messages.json").read_text())["vectors"]
ERRORS = json.loads((VECTORS / "errors.json").read_text())["vectors"]
# The capabilities' own files (shm-v1 §16, nixl-v1 §20) hold theirs in the same form.
for _file in ("shm.json", "nixl.json"):
    _vectors = json.loads((VECTORS / _file).read_text())
    MESSAGES += _vectors["messages"]
    ERRORS += _vectors["errors"]


def jsonable(value: Any) -> Any:
    if value is ABSENT:
        return {"absent": True}
    if isinstance(value, IdentityExtension):
        return value.to_wire()  # the wire map: declared fields only
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bin": bytes(value).hex()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (Geometry, KeyHash, Reason)) or dataclasses.is_dataclass(value):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def as_vector(msg: Message) -> dict[str, Any]:
    fields = {f.name: jsonable(getattr(msg, f.name)) for f in dataclasses.fields(msg)}
    if fields.get("payload") == []:
        del fields["payload"]
    if fields.get("pk") is False:  # packed-v1 (SPEC 17): listed only when set
        del fields["pk"]
    return {"type": msg.TAG, "fields": fields}


def frames_of(vector: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(f) for f in vector["frames"]]


@pytest.mark.parametrize("vector", MESSAGES, ids=[v["name"] for v in MESSAGES])
def test_message_vector_decodes(vector: dict[str, Any]) -> None:
    msg = decode(frames_of(vector), vector["segments"])
    assert as_vector(msg) == vector["message"]


@pytest.mark.parametrize("vector", MESSAGES, ids=[v["name"] for v in MESSAGES])
def test_message_vector_reencodes_to_same_message(vector: dict[str, Any]) -> None:
    msg = decode(frames_of(vector), vector["segments"])
    again = decode([bytes(f) for f in encode(msg)], vector["segments"])
    assert as_vector(again) == vector["message"]


@pytest.mark.parametrize("vector", ERRORS, ids=[v["name"] for v in ERRORS])
def test_error_vector_raises_its_code(vector: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        decode(frames_of(vector), vector["segments"])
    assert excinfo.value.code == vector["code"], excinfo.value.message
    assert excinfo.value.message


def test_vectors_cover_every_message_type() -> None:
    types = {v["message"]["type"] for v in MESSAGES}
    assert types == {"hello", "welcome", "refuse", "lookup", "hits", "fetch", "credit",
                     "block", "done", "abort", "abort_ack", "ping", "pong", "bye", "error",
                     "attach", "attached", "located", "release"}  # with shm-v1's


def test_error_vectors_use_known_codes() -> None:
    known = {int(c) for c in Code}
    assert {v["code"] for v in ERRORS} <= known
    assert len({v["name"] for v in ERRORS}) == len(ERRORS)


def test_hello_vectors_cover_both_protocol_minors() -> None:
    hellos = [v["message"]["fields"] for v in MESSAGES if v["message"]["type"] == "hello"]
    assert any(h["minor"] == 0 and h["ext"] is None for h in hellos)  # what 1.0 peers send
    assert any(h["minor"] == 1 and h["ext"] for h in hellos)


def test_frame0_larger_than_limit_is_too_large() -> None:
    from p2pkv.protocol.codes import MAX_HEAD_BYTES

    with pytest.raises(ProtocolError) as excinfo:
        decode([b"\x80" + b"\x00" * MAX_HEAD_BYTES])
    assert excinfo.value.code == Code.TOO_LARGE


def test_spec_worked_example_matches_the_codec() -> None:
    from p2pkv.identity import RunConfig
    from p2pkv.protocol import Block, Hello, Lookup, block_checksum, encode_head

    spec = (VECTORS.parent / "SPEC.md").read_text(encoding="utf-8")
    full = spec.split("Full frame:", 1)[1].split("```", 2)[1]
    hello = Hello.for_config("a", RunConfig("m"), Geometry.of([4096]), KeyHash("xxh3-128", 0))
    assert "".join(full.split()) == encode_head(hello).hex()
    lookup = encode_head(Lookup(1, (bytes.fromhex("00112233"),))).hex()
    block = encode_head(Block(1, (0,), (block_checksum([bytes(4096)]),))).hex()
    flat = "".join(spec.split())
    assert lookup in flat and block in flat


# ---------------------------------------------------------------------- block keys, fill

KEYS = json.loads((VECTORS / "keys.json").read_text(encoding="utf-8"))["vectors"]
FILL = json.loads((VECTORS / "fill.json").read_text())["vectors"]


def _extra(entry: dict[str, Any]) -> int | str | bytes:
    (kind, value), = entry.items()
    return bytes.fromhex(value) if kind == "bytes" else value  # type: ignore[no-any-return]


@pytest.mark.parametrize("vector", KEYS, ids=[v["name"] for v in KEYS])
def test_block_key_vector(vector: dict[str, Any]) -> None:
    from p2pkv.keys import block_keys, content_hash, root_hash

    seed, tph = vector["seed"], vector["tokens_per_hash"]
    parent = None if vector["parent_hash"] is None else bytes.fromhex(vector["parent_hash"])
    extras = [_extra(e) for e in vector["extra_keys"]]
    keys = block_keys(vector["token_ids"], seed=seed, tokens_per_block=tph,
                      group=vector["group"], extra_keys=extras, parent_hash=parent)
    assert [k.hex() for k in keys] == vector["keys"]
    assert root_hash(seed).hex() == vector["root"]
    chain = parent or root_hash(seed)
    for i, want in enumerate(vector["content_hashes"]):
        chain = content_hash(chain, vector["token_ids"][i * tph:(i + 1) * tph], seed=seed,
                             extra_keys=extras)
        assert chain.hex() == want
        assert bytes.fromhex(vector["messages"][i])[:16] == (
            bytes.fromhex(vector["content_hashes"][i - 1]) if i else parent or root_hash(seed))


def test_block_key_vectors_chain_across_calls() -> None:
    by_name = {v["name"]: v for v in KEYS}
    assert by_name["parent_hash_continues_a_chain"]["keys"] == (
        by_name["three_blocks_and_a_tail"]["keys"][1:])
    assert by_name["tail_only_has_no_key"]["keys"] == []
    equal = by_name["equal_blocks_at_different_positions"]["keys"]
    assert len(set(equal)) == len(equal) == 3


@pytest.mark.parametrize("vector", FILL, ids=[v["name"] for v in FILL])
def test_fill_vector(vector: dict[str, Any]) -> None:
    import hashlib

    import xxhash

    from p2pkv.fill import fill_block, fill_keys

    keys = fill_keys(vector["count"], seed=vector["seed"],
                     tokens_per_hash=vector["tokens_per_hash"])
    assert [k.hex() for k in keys] == [b["key"] for b in vector["blocks"]]
    for key, want in zip(keys, vector["blocks"], strict=True):
        data = fill_block(key, vector["bytes_per_block"])
        assert data[:32].hex() == want["first_bytes"]
        assert xxhash.xxh3_64_intdigest(data) == want["xxh3_64"]
        assert hashlib.sha256(data).hexdigest() == want["sha256"]
        if "bytes" in want:
            assert data.hex() == want["bytes"]


# ------------------------------------------------------------- the sealed stream (§18.8)

SEALED = json.loads((VECTORS / "sealed.json").read_text())
SEAL_SECRET = bytes.fromhex(SEALED["secret"])
SEAL_TOKEN = bytes.fromhex(SEALED["token"])
SEALED_RECORDS = {r["name"]: r for r in SEALED["records"]}


def test_sealed_traffic_keys() -> None:
    from p2pkv.protocol.seal import traffic_key

    assert len(SEALED["keys"]) == 3
    for entry in SEALED["keys"]:
        key = traffic_key(SEAL_SECRET, SEAL_TOKEN, entry["writer"], entry["epoch"])
        assert key.hex() == entry["key"], entry
    with pytest.raises(ValueError):
        traffic_key(SEAL_SECRET[:31], SEAL_TOKEN, "server", 0)
    with pytest.raises(ValueError):
        traffic_key(SEAL_SECRET, SEAL_TOKEN, "relay", 0)


def test_sealed_preface() -> None:
    from p2pkv.protocol.seal import (
        SEALED_MAGIC,
        SEALED_PREFACE_BYTES,
        check_sealed_preface,
        sealed_preface,
        sealed_token_of,
    )

    want = bytes.fromhex(SEALED["preface"]["bytes"])
    assert sealed_preface(SEAL_SECRET, SEAL_TOKEN) == want
    assert len(want) == SEALED_PREFACE_BYTES == 40
    assert want == SEALED_MAGIC + SEAL_TOKEN + bytes.fromhex(SEALED["preface"]["tag"])
    assert sealed_token_of(want) == SEAL_TOKEN
    assert check_sealed_preface(SEAL_SECRET, want)
    # A plain preface (§18.2) is not a sealed one.
    from p2pkv.protocol import preface

    assert sealed_token_of(preface(SEAL_TOKEN)) is None
    assert not check_sealed_preface(SEAL_SECRET, preface(SEAL_TOKEN))


@pytest.mark.parametrize("vector", SEALED["records"], ids=list(SEALED_RECORDS))
def test_sealed_record_vector(vector: dict[str, Any]) -> None:
    from p2pkv.protocol.seal import RecordKeys, open_record, seal_record

    plaintext, wire = bytes.fromhex(vector["plaintext"]), bytes.fromhex(vector["bytes"])
    keys = RecordKeys(SEAL_SECRET, SEAL_TOKEN, vector["writer"], vector["number"])
    assert seal_record(keys, plaintext) == wire
    assert keys.next == vector["number"] + 1
    keys = RecordKeys(SEAL_SECRET, SEAL_TOKEN, vector["writer"], vector["number"])
    assert open_record(keys, wire) == plaintext
    assert keys.next == vector["number"] + 1


def test_sealed_answer_and_epochs() -> None:
    from p2pkv.protocol import ACCEPTED
    from p2pkv.protocol.seal import ANSWER_RECORD_BYTES, RecordKeys, seal_record

    answer = SEALED_RECORDS["answer"]
    assert bytes.fromhex(answer["plaintext"]) == ACCEPTED
    assert len(bytes.fromhex(answer["bytes"])) == ANSWER_RECORD_BYTES == 28
    # One RecordKeys takes the next epoch's key at record 65536.
    keys = RecordKeys(SEAL_SECRET, SEAL_TOKEN, "server", 65535)
    for name in ("record_65535_last_of_epoch_0", "record_65536_first_of_epoch_1"):
        vector = SEALED_RECORDS[name]
        assert seal_record(keys, bytes.fromhex(vector["plaintext"])).hex() == vector["bytes"]
    # And the record after the answer is record 1, on the same keys.
    keys = RecordKeys(SEAL_SECRET, SEAL_TOKEN, "server")
    for name in ("answer", "record_1_framed_done"):
        vector = SEALED_RECORDS[name]
        assert seal_record(keys, bytes.fromhex(vector["plaintext"])).hex() == vector["bytes"]


@pytest.mark.parametrize("vector", SEALED["invalid"], ids=[v["name"] for v in SEALED["invalid"]])
def test_sealed_invalid_vector_is_rejected(vector: dict[str, Any]) -> None:
    from p2pkv.protocol.seal import RecordKeys, SealError, check_sealed_preface, open_record

    wire = bytes.fromhex(vector["bytes"])
    secret = bytes.fromhex(vector.get("secret", SEALED["secret"]))
    token = bytes.fromhex(vector.get("token", SEALED["token"]))
    if vector["kind"] == "preface":
        assert not check_sealed_preface(secret, wire)
        return
    keys = RecordKeys(secret, token, vector["writer"], vector["number"])
    with pytest.raises(SealError):
        open_record(keys, wire)


def test_sealed_socket_writes_and_reads_the_vectors() -> None:
    """The reference's socket puts the vectors' bytes on the wire, opens them, and ends
    the stream at a head that cannot be a record's (§18.8)."""
    import socket

    from p2pkv.protocol import ACCEPTED
    from p2pkv.protocol.seal import RecordKeys, SealError
    from p2pkv.transport.sealed import SealedSocket

    answer, first = SEALED_RECORDS["answer"], SEALED_RECORDS["record_1_framed_done"]
    a, b = socket.socketpair()
    with a, b:
        server = SealedSocket(a, sealer=RecordKeys(SEAL_SECRET, SEAL_TOKEN, "server"))
        server.sendall(ACCEPTED)
        assert server.send_records([memoryview(bytes.fromhex(first["plaintext"]))]) == len(
            bytes.fromhex(first["plaintext"]))
        wire = bytes.fromhex(answer["bytes"]) + bytes.fromhex(first["bytes"])
        got = b""
        while len(got) < len(wire):
            got += b.recv(len(wire) - len(got))
        assert got == wire
        server.close()
    a, b = socket.socketpair()
    with a, b:
        client = SealedSocket(b, opener=RecordKeys(SEAL_SECRET, SEAL_TOKEN, "server", 1))
        a.sendall(bytes.fromhex(first["bytes"]))
        out = bytearray(len(bytes.fromhex(first["plaintext"])))
        assert client.recv_records([memoryview(out)]) == len(out)
        assert out.hex() == first["plaintext"]
        client.close()
    for vector in (v for v in SEALED["invalid"] if v.get("rejected_at_head")):
        a, b = socket.socketpair()
        with a, b:
            client = SealedSocket(b, opener=RecordKeys(SEAL_SECRET, SEAL_TOKEN, "server",
                                                       vector["number"]))
            a.sendall(bytes.fromhex(vector["bytes"])[:4])  # the head alone decides
            with pytest.raises(SealError):
                client.recv_records([memoryview(bytearray(64))])
            client.close()


@pytest.mark.parametrize("case", SEALED["forms"], ids=[
    f"{'+'.join(c['caps'])}:{'+'.join(c['data']) or 'nothing'}" for c in SEALED["forms"]])
def test_stream_form_vector(case: dict[str, Any]) -> None:
    from p2pkv.protocol import DataOffer, stream_form
    from p2pkv.protocol.datachannel import kept_offer

    offer = DataOffer(40123, SEAL_TOKEN, 5555, (),
                      bytes(32) if "cert" in case["data"] else None,
                      SEAL_SECRET if "key" in case["data"] else None)
    caps = frozenset(case["caps"])
    assert stream_form(caps, kept_offer(caps, offer)) == case["form"]


def test_sealed_welcome_vector_carries_the_sealed_inputs() -> None:
    """The sealed welcome of datachannel.json offers the token and secret that
    sealed.json's keys come from; its session's streams are sealed."""
    from p2pkv.protocol import Welcome, stream_form
    from p2pkv.protocol.datachannel import kept_offer

    channel = json.loads((VECTORS / "datachannel.json").read_text())
    by_name = {v["name"]: v for v in channel["messages"]}
    errors = {v["name"]: v["code"] for v in channel["errors"]}
    assert errors["welcome_data_key_short"] == errors["welcome_data_key_long"] == (
        Code.OUT_OF_BOUNDS)
    assert errors["welcome_data_key_str"] == Code.WRONG_TYPE
    for name, form in (("welcome_offers_sealed_stream", "sealed"),
                       ("welcome_tls_only_carries_key_decoded_then_ignored", "tls")):
        welcome = decode(frames_of(by_name[name]))
        assert isinstance(welcome, Welcome) and welcome.data is not None
        assert (welcome.data.token, welcome.data.key) == (SEAL_TOKEN, SEAL_SECRET)
        kept = kept_offer(frozenset(welcome.caps), welcome.data)
        assert stream_form(frozenset(welcome.caps), kept) == form
        assert kept is not None and (kept.key is None) == (form != "sealed")
