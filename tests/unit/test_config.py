import pytest

from p2pkv.config import (
    AUTH_SECRET_ENV,
    ExtraConfig,
    LoadFailurePolicy,
    Role,
    SendType,
    parse_connector_config,
    parse_extra_config,
)
from p2pkv.errors import ConfigError


def test_defaults_match_the_old_connector() -> None:
    config = parse_extra_config({})
    assert config.send_type is SendType.PUT_ASYNC
    assert config.nccl_num_channels == 8
    assert config.mem_pool_size_gb == 32.0
    assert config.kv_buffer_size == 1e9
    assert config.proxy_ip == ""


def test_legacy_keys_parse_with_their_old_spellings() -> None:
    config = parse_extra_config({
        "proxy_ip": "10.0.0.1", "proxy_port": "30001", "http_port": 8100, "send_type": "put",
        "nccl_num_channels": "16", "mem_pool_size_gb": 4, "kv_buffer_size": "5e8",
    })
    assert config.proxy_port == 30001 and config.http_port == 8100
    assert config.send_type is SendType.PUT
    assert config.nccl_num_channels == 16
    assert config.mem_pool_size_gb == 4.0
    assert config.kv_buffer_size == 5e8


def test_weights_are_compared_with_peers_unless_turned_off() -> None:
    assert parse_extra_config({}).weights_check is True
    assert parse_extra_config({"weights_check": False}).weights_check is False


def test_unknown_key_names_the_key_and_the_accepted_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown .*'kv_bufer_size'.*accepted keys: .*kv_buffer_size"):
        parse_extra_config({"kv_bufer_size": 1})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("send_type", "PUSH", r"send_type: expected one of PUT, PUT_ASYNC, GET, got 'PUSH'"),
        ("nccl_num_channels", "eight", r"nccl_num_channels: expected an integer in \[1, 64\]"),
        ("nccl_num_channels", 0, r"nccl_num_channels: expected an integer in \[1, 64\]"),
        ("kv_buffer_size", 0, r"kv_buffer_size: expected a number in \(0"),
        ("kv_buffer_size", True, r"kv_buffer_size: expected a number"),
        ("proxy_port", 70000, r"proxy_port: expected an integer in \[0, 65535\]"),
        ("transfer_timeout_s", -1, r"transfer_timeout_s: expected a number"),
        ("test_fault_injection", "maybe", r"test_fault_injection: expected true or false"),
        ("weights_check", "sometimes", r"weights_check: expected true or false"),
        ("proxy_ip", 5, r"proxy_ip: expected a string"),
    ],
)
def test_bad_values_name_the_key_and_what_it_accepts(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_extra_config({key: value})


def test_proxy_needs_http_port_and_both_halves() -> None:
    with pytest.raises(ConfigError, match="http_port: required"):
        parse_extra_config({"proxy_ip": "127.0.0.1", "proxy_port": 30001})
    with pytest.raises(ConfigError, match="proxy_ip and proxy_port"):
        parse_extra_config({"proxy_ip": "127.0.0.1", "http_port": 8000})


def test_secret_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTH_SECRET_ENV, "s3cret")
    assert parse_extra_config({}).auth_secret == "s3cret"
    assert parse_extra_config({"auth_secret": "explicit"}).auth_secret == "explicit"


def test_connector_config_and_worker_ports() -> None:
    config = parse_connector_config("kv_consumer", 21001, "recompute", {"send_type": "PUT"})
    assert config.role is Role.CONSUMER
    assert config.failure_policy is LoadFailurePolicy.RECOMPUTE
    assert config.worker_port(3) == 21004
    assert isinstance(config.extra, ExtraConfig)
    with pytest.raises(ConfigError, match="kv_role: expected one of kv_producer, kv_consumer, kv_both"):
        parse_connector_config("producer", 21001, "fail", {})
