import struct

import msgspec
import pytest

from p2pkv.errors import ProtocolError
from p2pkv.protocol import (
    PREFIX_BYTES,
    BlockPlaces,
    FrameAuth,
    FrameLimits,
    Hello,
    LayerPlace,
    LayoutDigest,
    PipeOpen,
    PullReply,
    PullRequest,
    PushAbort,
    PushBlocks,
    decode_message,
    decode_prefix,
    encode_frame,
)

LAYOUT = LayoutDigest(4, 128, 131072, "float32", (2, 128, 128), "cpu:AVX512")


def _split(frame: bytes) -> tuple[bytes, bytes]:
    return frame[:PREFIX_BYTES], frame[PREFIX_BYTES:]


@pytest.mark.parametrize("secret", [b"", b"shared"])
def test_round_trip(secret: bytes) -> None:
    message = PushBlocks("t1", 2, 0, 3, 3, 4)
    prefix_raw, body = _split(encode_frame(message, 393216, secret))
    prefix = decode_prefix(prefix_raw, FrameLimits())
    assert prefix.payload_len == 393216
    assert decode_message(prefix_raw, prefix, body, secret) == message
    hello = Hello("e1", 0, LAYOUT)
    prefix_raw, body = _split(encode_frame(hello, 0, secret))
    assert decode_message(prefix_raw, decode_prefix(prefix_raw, FrameLimits()), body, secret) == hello


@pytest.mark.parametrize("message", [
    Hello("e1", 0, LAYOUT, pipe_kind="nccl"),
    PipeOpen(bytes(range(128))),
    PullRequest("t1", 0, 3, by_pipe=True),
    PullReply("t1", True, by_pipe=True),
    BlockPlaces("t1", bytes(range(8)), [LayerPlace(0, 4096, 65536, ((0, 32768), (32768, 32768)))], 7),
])
def test_pipe_messages_round_trip(message: object) -> None:
    prefix_raw, body = _split(encode_frame(message, 0, b"k"))  # type: ignore[arg-type]
    assert decode_message(prefix_raw, decode_prefix(prefix_raw, FrameLimits()), body, b"k") == message


def test_where_a_long_requests_blocks_lie_fits_one_small_frame() -> None:
    """A 128k-token prompt of Llama-3-8B (8192 blocks of 16 tokens, 32 layers, descending ids) placed for a pull by
    reference: the ids and one place per layer, under the default frame cap's 64 KiB by far."""
    ids = list(range(8192, 0, -1))
    layers = [LayerPlace(0, layer * (1 << 30), 65536, ((0, 65536),)) for layer in range(32)]
    frame = encode_frame(BlockPlaces("t", b"".join(i.to_bytes(4, "little") for i in ids), layers), 0, b"")
    assert len(frame) < 40_000


def test_hmac_refuses_wrong_or_missing_secret() -> None:
    prefix_raw, body = _split(encode_frame(PushBlocks("t1", 0, 0, 1, 1, 1), 10, b"right"))
    prefix = decode_prefix(prefix_raw, FrameLimits())
    with pytest.raises(ProtocolError, match="authentication"):
        decode_message(prefix_raw, prefix, body, b"wrong")
    unsigned_raw, unsigned_body = _split(encode_frame(PushBlocks("t1", 0, 0, 1, 1, 1), 10, b""))
    with pytest.raises(ProtocolError, match="authentication"):
        decode_message(unsigned_raw, decode_prefix(unsigned_raw, FrameLimits()), unsigned_body, b"right")


def test_tampered_message_is_refused() -> None:
    prefix_raw, body = _split(encode_frame(PushBlocks("t1", 0, 0, 1, 1, 1), 10, b"k"))
    tampered = body.replace(b"t1", b"t2")
    with pytest.raises(ProtocolError, match="authentication"):
        decode_message(prefix_raw, decode_prefix(prefix_raw, FrameLimits()), tampered, b"k")


def test_prefix_validation_before_allocation() -> None:
    good = encode_frame(PushBlocks("t", 0, 0, 1, 1, 1), 0, b"")[:PREFIX_BYTES]
    with pytest.raises(ProtocolError, match="magic"):
        decode_prefix(b"XXXX" + good[4:], FrameLimits())
    with pytest.raises(ProtocolError, match="version"):
        decode_prefix(good[:4] + struct.pack("!H", 99) + good[6:], FrameLimits())
    huge = good[:8] + struct.pack("!IQ", 1 << 31, 0) + good[20:]
    with pytest.raises(ProtocolError, match="exceeds the cap"):
        decode_prefix(huge, FrameLimits())
    huge_payload = good[:8] + struct.pack("!IQ", 10, 1 << 60) + good[20:]
    with pytest.raises(ProtocolError, match="exceeds the cap"):
        decode_prefix(huge_payload, FrameLimits())
    with pytest.raises(ProtocolError, match="short"):
        decode_prefix(good[:10], FrameLimits())


def test_garbage_message_body() -> None:
    prefix_raw = encode_frame(PushBlocks("t", 0, 0, 1, 1, 1), 0, b"")[:PREFIX_BYTES]
    fake = prefix_raw[:8] + struct.pack("!IQ", 5, 0) + prefix_raw[20:]
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_message(fake, decode_prefix(fake, FrameLimits()), b"\xff\x00ab", b"")


def test_layout_differences_name_the_field() -> None:
    other = LayoutDigest(4, 16, 131072, "bfloat16", (2, 128, 128), "cpu:AVX512")
    diffs = LAYOUT.differences(other)
    assert any(d.startswith("block_size") for d in diffs)
    assert any(d.startswith("dtype") for d in diffs)
    assert len(diffs) == 2
    # Another pipeline stage of the same model: same shapes, other layers.
    later_stage = msgspec.structs.replace(LAYOUT, first_layer=LAYOUT.num_layers)
    assert LAYOUT.differences(later_stage) == [f"first_layer: ours 0, peer {LAYOUT.num_layers}"]


def test_stages_of_one_model_that_hold_other_layers_may_pull_from_each_other() -> None:
    n = LAYOUT.num_layers
    whole = msgspec.structs.replace(LAYOUT, num_layers=2 * n, total_layers=2 * n)
    second = msgspec.structs.replace(LAYOUT, first_layer=n, total_layers=2 * n)
    assert whole.layers_with(second) and whole.sliced_with(second) and not whole.slices_with(second)
    assert whole.differences(second) == []
    assert not second.layers_with(second) and not second.sliced_with(second)
    # Another model (its layer count differs), or one whose layer count is not known: refused.
    other_model = msgspec.structs.replace(second, total_layers=3 * n)
    assert f"total_layers: ours {2 * n}, peer {3 * n}" in whole.differences(other_model)
    unknown = msgspec.structs.replace(second, total_layers=0)
    assert not whole.layers_with(unknown) and whole.differences(unknown)


def test_layouts_of_the_same_shape_computed_another_way_differ_by_each_model_factor() -> None:
    ours = msgspec.structs.replace(
        LAYOUT, model='architecture=Llama;quantization=none;rope_parameters={"rope_theta":1}')
    theirs = msgspec.structs.replace(
        LAYOUT, model='architecture=Llama;quantization=fp8;rope_parameters={"rope_theta":2};sliding_window=4096')
    assert ours.differences(theirs) == [
        "model.quantization: ours none, peer fp8",
        'model.rope_parameters: ours {"rope_theta":1}, peer {"rope_theta":2}',
        "model.sliding_window: ours unset, peer 4096",
    ]
    assert ours.differences(msgspec.structs.replace(ours)) == []
    # A peer that does not say (an older p2pkv, or a digest made without vLLM's config) is not compared.
    assert ours.differences(LAYOUT) == [] and LAYOUT.differences(ours) == []
    # The weights' fingerprint differs as any factor does, but only where both sides know it (`p2pkv.weights`).
    weighed = msgspec.structs.replace(ours, model=ours.model + ";weights=0123456789abcdef")
    other_weights = msgspec.structs.replace(ours, model=ours.model + ";weights=fedcba9876543210")
    assert weighed.differences(other_weights) == ["model.weights: ours 0123456789abcdef, peer fedcba9876543210"]
    assert weighed.differences(ours) == [] and ours.differences(weighed) == []
    assert weighed.differences(theirs)[0] == "model.quantization: ours none, peer fp8"
    assert "model.weights" not in " ".join(weighed.differences(theirs))
    # It travels in the hello.
    hello = Hello("e", 0, ours)
    prefix_raw, body = _split(encode_frame(hello, 0, b""))
    assert decode_message(prefix_raw, decode_prefix(prefix_raw, FrameLimits()), body, b"") == hello


def test_a_connection_frame_checks_only_in_its_direction_sequence_and_connection() -> None:
    """Per-connection keys, one per direction, over a sequence number: a frame is accepted once, by the other side
    of its own connection, in order; sent back to its sender (a reflection), played again, or taken to another
    connection, it fails."""
    def pair(client_nonce: bytes, server_nonce: bytes) -> tuple[FrameAuth, FrameAuth]:
        client, server = FrameAuth(b"shared"), FrameAuth(b"shared")
        client.bind(client_nonce, server_nonce, client=True)
        server.bind(client_nonce, server_nonce, client=False)
        return client, server

    def check(auth: FrameAuth, frame: bytes) -> object:
        head, body = _split(frame)
        return auth.decode(head, decode_prefix(head, FrameLimits()), body)

    client, server = pair(b"c" * 16, b"s" * 16)
    first, second = PushAbort("t", "one"), PushAbort("t", "two")
    sent = [client.encode(first, 0), client.encode(second, 0)]
    with pytest.raises(ProtocolError, match="authentication failed"):
        check(pair(b"c" * 16, b"s" * 16)[0], sent[0])  # back to a client of the same nonces: the other direction
    with pytest.raises(ProtocolError, match="authentication failed"):
        check(pair(b"c" * 16, b"x" * 16)[1], sent[0])  # another connection
    with pytest.raises(ProtocolError, match="authentication failed"):
        check(pair(b"c" * 16, b"s" * 16)[1], sent[1])  # out of order
    assert check(server, sent[0]) == first
    with pytest.raises(ProtocolError, match="authentication failed"):
        check(server, sent[0])  # played again
    assert check(server, sent[1]) == second  # a failed check does not move the sequence on
