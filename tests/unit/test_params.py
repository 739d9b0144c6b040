import pytest

from p2pkv.errors import ConfigError
from p2pkv.params import (
    Address,
    DecodeParams,
    DiscardParams,
    PrefillParams,
    ProbeAnswer,
    ProbeParams,
    legacy_params,
    parse_transfer_params,
    prompt_digest,
)


def test_prefill_and_decode_params_round_trip() -> None:
    pre = PrefillParams("abc123", Address("127.0.0.1", 22001))
    assert parse_transfer_params(pre.to_dict()) == pre
    dec = DecodeParams("abc123", 300, None)
    assert parse_transfer_params(dec.to_dict()) == dec
    corrupt = DecodeParams("abc123", 300, Address("::1", 5), test_corrupt=True)
    assert parse_transfer_params(corrupt.to_dict()) == corrupt
    assert parse_transfer_params(ProbeParams().to_dict()) == ProbeParams()
    sized = PrefillParams("abc123", None, decode_tp=2, decode_pp=4)
    assert parse_transfer_params(sized.to_dict()) == sized
    pulled_by = PrefillParams("abc123", Address("h", 1), pull=True, decode_launch="fedcba9876543210")
    assert pulled_by.to_dict()["decode_launch"] == "fedcba9876543210"
    assert parse_transfer_params(pulled_by.to_dict()) == pulled_by and "decode_launch" not in sized.to_dict()
    sized_back = DecodeParams("abc123", 300, None, prefill_tp=4, prefill_pp=2)
    assert parse_transfer_params(sized_back.to_dict()) == sized_back
    digested = DecodeParams("abc123", 3, None, prompt=prompt_digest([5, 6, 7]))
    assert parse_transfer_params(digested.to_dict()) == digested
    leased = DecodeParams("abc123", 3, Address("h", 1), pull=True, lease_s=12.5)
    assert leased.to_dict()["prefill_lease_s"] == 12.5 and parse_transfer_params(leased.to_dict()) == leased
    assert "prefill_lease_s" not in dec.to_dict()
    started = DecodeParams("abc123", 3, Address("h", 1), prefill_launch="0123456789abcdef")
    assert started.to_dict()["prefill_launch"] == "0123456789abcdef"
    assert parse_transfer_params(started.to_dict()) == started and "prefill_launch" not in dec.to_dict()


def test_discard_params_round_trip_and_follow_the_prefill_answer() -> None:
    bare = DiscardParams("abc123")
    assert bare.to_dict() == {"p2pkv": 1, "transfer_id": "abc123", "discard_transfer": True}
    assert parse_transfer_params(bare.to_dict()) == bare
    answer = DecodeParams("abc123", 300, Address("10.0.0.2", 21001), pull=True, prefill_tp=2, prefill_pp=1,
                          prompt=prompt_digest([1]))
    discard = DiscardParams.of(answer)
    assert discard == DiscardParams("abc123", Address("10.0.0.2", 21001), True, 2, 1)
    assert parse_transfer_params(discard.to_dict()) == discard


def test_prompt_digest_tells_prompts_apart() -> None:
    digest = prompt_digest([5, 6, 7])
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert prompt_digest((5, 6, 7)) == digest == prompt_digest(range(5, 8))
    assert prompt_digest([5, 6, 8]) != digest and prompt_digest([7, 6, 5]) != digest
    assert prompt_digest([5, 6, 7, 0]) != digest


def test_foreign_params_are_not_ours() -> None:
    assert parse_transfer_params(None) is None
    assert parse_transfer_params({"do_remote_prefill": True, "remote_block_ids": [1]}) is None


@pytest.mark.parametrize(
    "raw",
    [
        {"p2pkv": 2, "transfer_id": "x", "do_remote_decode": True},
        {"p2pkv": 1, "transfer_id": "has space", "do_remote_decode": True},
        {"p2pkv": 1, "transfer_id": "", "do_remote_decode": True},
        {"p2pkv": 1, "transfer_id": "x", "load_remote_kv": True, "num_prompt_tokens": 0},
        {"p2pkv": 1, "transfer_id": "x", "load_remote_kv": True, "num_prompt_tokens": True},
        {"p2pkv": 1, "transfer_id": "x"},
        {"p2pkv": 1, "transfer_id": "x", "do_remote_decode": True, "decode_kv_address": "nohost"},
        {"p2pkv": 1, "transfer_id": "x", "do_remote_decode": True, "decode_pp_size": -1},
        {"p2pkv": 1, "transfer_id": "x", "do_remote_decode": True, "decode_launch": "0123"},
        {"p2pkv": 1, "transfer_id": "x", "load_remote_kv": True, "num_prompt_tokens": 3, "prefill_pp_size": "2"},
        {"p2pkv": 1, "transfer_id": "x", "load_remote_kv": True, "num_prompt_tokens": 3, "prompt_digest": 7},
        {"p2pkv": 1, "transfer_id": "x", "load_remote_kv": True, "num_prompt_tokens": 3, "prompt_digest": "XYZ"},
        {"p2pkv": 1, "transfer_id": "x", "load_remote_kv": True, "num_prompt_tokens": 3, "prefill_lease_s": "30"},
        {"p2pkv": 1, "transfer_id": "x", "load_remote_kv": True, "num_prompt_tokens": 3, "prefill_lease_s": -1},
        {"p2pkv": 1, "transfer_id": "x", "load_remote_kv": True, "num_prompt_tokens": 3, "prefill_lease_s": 1e9},
        {"p2pkv": 1, "transfer_id": "x", "load_remote_kv": True, "num_prompt_tokens": 3, "prefill_lease_s": True},
        {"p2pkv": 1, "transfer_id": "x", "load_remote_kv": True, "num_prompt_tokens": 3, "prefill_launch": 5},
        {"p2pkv": 1, "transfer_id": "x", "load_remote_kv": True, "num_prompt_tokens": 3, "prefill_launch": "a b"},
        {"p2pkv": 1, "transfer_id": "x", "discard_transfer": True, "send_type": "GET"},  # GET: from where?
        {"p2pkv": 1, "transfer_id": "x", "discard_transfer": True, "prefill_tp_size": 0.5},
        {"p2pkv": 1, "transfer_id": "x", "discard_transfer": "yes"},
    ],
)
def test_malformed_p2pkv_params_raise(raw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        parse_transfer_params(raw)


def test_address_parsing() -> None:
    assert Address.parse("10.1.2.3:21001") == Address("10.1.2.3", 21001)
    assert Address.parse("[::1]:80") == Address("::1", 80)
    assert str(Address("::1", 80)) == "[::1]:80"
    assert Address("h", 100).offset(2) == Address("h", 102)
    with pytest.raises(ConfigError):
        Address.parse("host:99999")


def test_probe_answer() -> None:
    assert ProbeAnswer(21001, "").to_dict() == {"p2pkv": 1, "kv_port": 21001, "kv_host": ""}
    assert ProbeAnswer(21001, "", 2, 3).to_dict() == {"p2pkv": 1, "kv_port": 21001, "kv_host": "", "tp_size": 2,
                                                      "pp_size": 3}


LEGACY_HEX = "0123456789abcdef" * 2


@pytest.mark.parametrize(("request_id", "transfer_id"), [
    # vLLM's id for the first prompt of a completion: `cmpl-`, the old proxy's X-Request-Id, the index, a suffix
    (f"cmpl-___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_{LEGACY_HEX}-0-1a2b3c4d",
     f"legacy-{LEGACY_HEX}-0"),
    (f"cmpl-___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_{LEGACY_HEX}-12-99999999",
     f"legacy-{LEGACY_HEX}-12"),
    # a chat completion has no index, and its suffix may be all digits
    (f"chatcmpl-___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_{LEGACY_HEX}-12345678",
     f"legacy-{LEGACY_HEX}"),
    # a sample of a request with n > 1: the same transfer as its siblings
    (f"2_cmpl-___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_{LEGACY_HEX}-0-1a2b3c4d",
     f"legacy-{LEGACY_HEX}-0"),
])
def test_an_old_proxys_request_id_stands_for_params(request_id: str, transfer_id: str) -> None:
    prefill, decode = Address("10.0.0.1", 21001), Address("10.0.0.2", 22001)
    assert legacy_params(request_id, True, 300, False) == PrefillParams(transfer_id, decode)
    assert legacy_params(request_id, True, 300, True) == PrefillParams(transfer_id, decode, pull=True)
    assert legacy_params(request_id, False, 300, False) == DecodeParams(transfer_id, 300, prefill)
    assert legacy_params(request_id, False, 300, True) == DecodeParams(transfer_id, 300, prefill, pull=True)
    assert legacy_params(request_id, False, 0, False) is None  # no prompt, nothing to load


@pytest.mark.parametrize("request_id", [
    "cmpl-0123456789abcdef-0-1a2b3c4d",  # any other id
    f"cmpl-___prefill_addr_10.0.0.1___decode_addr_10.0.0.2:22001_{LEGACY_HEX}-0-1",  # no port
    f"cmpl-___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_{LEGACY_HEX[:31]}-0-1",  # short id
    f"cmpl-___prefill_addr_h:1___decode_addr_h:99999_{LEGACY_HEX}-0-1",  # port out of range
])
def test_other_request_ids_stand_for_nothing(request_id: str) -> None:
    assert legacy_params(request_id, True, 300, False) is None
    assert legacy_params(request_id, False, 300, False) is None
