"""`p2pkv up`: what each instance of the cluster it would start is given (nothing is started here), and how it reads
the demo request's answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from p2pkv.bench.cluster import free_port
from p2pkv.cli.main import build_parser
from p2pkv.cli.up import DEMO_QUESTION, build_cluster, has_chat_template, listed_refusals, send_demo_request
from p2pkv.config import AUTH_SECRET_ENV
from p2pkv.errors import ConfigError
from p2pkv.proxy.admin import ADMIN_KEY_ENV
from p2pkv.proxy.trace import TRANSFER_HEADER
from tests.helpers.servers import serve


def _extras(tmp_path: Path, *argv: str) -> dict[str, dict[str, Any]]:
    """Each instance's kv_connector_extra_config, by instance name, as it would be passed to vLLM."""
    args = build_parser().parse_args(["up", "--model", "m", "--prefill", "1", "--decode", "2", *argv])
    cluster, _ = build_cluster(args, "m", tmp_path)
    out = {}
    for proc in cluster.processes:
        if proc.name != "proxy":
            config = json.loads(proc.argv[proc.argv.index("--kv-transfer-config") + 1])
            out[proc.name] = config["kv_connector_extra_config"]
    return out


def test_role_extra_configs_apply_to_their_role_over_the_shared_one(tmp_path: Path) -> None:
    extras = _extras(tmp_path, "--extra-config", '{"lease_s": 10, "auth_secret": "s"}',
                     "--prefill-extra-config", '{"lease_s": 60}', "--decode-extra-config", '{"kv_buffer_size": 8e9}')
    assert set(extras) == {"prefill0", "decode0", "decode1"}
    assert extras["prefill0"]["lease_s"] == 60 and "kv_buffer_size" not in extras["prefill0"]
    for name in ("decode0", "decode1"):
        assert extras[name]["lease_s"] == 10 and extras[name]["kv_buffer_size"] == 8e9
    assert {e["auth_secret"] for e in extras.values()} == {"s"}
    assert len({e["metrics_port"] for e in extras.values()}) == 3  # each its own ports still


def test_a_send_type_for_one_role_applies_to_it_over_the_shared_one(tmp_path: Path) -> None:
    """Decode instances that pull (GET) beside prefill instances that push: links pull when either side says GET."""
    extras = _extras(tmp_path, "--send-type", "PUT", "--decode-extra-config", '{"send_type": "GET"}')
    assert [extras[name]["send_type"] for name in ("prefill0", "decode0", "decode1")] == ["PUT", "GET", "GET"]


def test_a_cluster_without_a_secret_gets_one_of_its_own_kept_off_command_lines(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process (the proxy too) signs with the same generated secret, given in its environment; a secret
    given is used instead."""
    monkeypatch.delenv(AUTH_SECRET_ENV, raising=False)
    args = build_parser().parse_args(["up", "--model", "m", "--prefill", "1", "--decode", "2"])
    cluster, description = build_cluster(args, "m", tmp_path)
    secrets = {proc.env.get(AUTH_SECRET_ENV) for proc in cluster.processes}
    assert len(secrets) == 1 and len(next(iter(secrets)) or "") == 64
    assert not any(next(iter(secrets)) in " ".join(proc.argv) for proc in cluster.processes)
    assert next(iter(secrets)) not in json.dumps(description)
    args = build_parser().parse_args(["up", "--model", "m", "--extra-config", '{"auth_secret": "s"}'])
    cluster, _ = build_cluster(args, "m", tmp_path)
    assert AUTH_SECRET_ENV not in cluster.extra_env


def test_off_loopback_its_own_polls_of_the_proxy_carry_an_admin_key(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`p2pkv up --host ADDRESS` calls the proxy's `/instances` (an admin route) from beyond loopback: its proxy gets
    a generated admin key, which its polls send; on loopback none is made."""
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    args = build_parser().parse_args(["up", "--model", "m", "--host", "10.1.2.3", "--base-port", "20000",
                                      "--port", "20999"])
    cluster, _ = build_cluster(args, "m", tmp_path)
    keys = {proc.env.get(ADMIN_KEY_ENV) for proc in cluster.processes}
    assert len(keys) == 1 and len(next(iter(keys)) or "") == 64
    args = build_parser().parse_args(["up", "--model", "m"])
    assert ADMIN_KEY_ENV not in build_cluster(args, "m", tmp_path)[0].extra_env
    app = FastAPI()
    seen: list[str] = []

    @app.get("/instances")
    async def instances(request: Request) -> dict[str, Any]:
        seen.append(request.headers.get("authorization", ""))
        return {"instances": [{"role": "decode", "address": "x", "refused": [{"address": "y", "reason": "r"}]}]}

    with serve(app) as address:
        assert listed_refusals(f"http://{address}", 1.0, "k3y") == ["decode instance x refused the KV worker at y: r"]
    assert seen == ["Bearer k3y"]


def test_a_host_this_machine_cannot_bind_is_said_not_looped_on() -> None:
    with pytest.raises(ConfigError, match=r"is 10\.1\.2\.3 an address of this host"):
        free_port("10.1.2.3")


@pytest.mark.parametrize(("argv", "message"), [
    (["--prefill-extra-config", '{"auth_secret": "x"}'], "--prefill-extra-config: auth_secret must be the same"),
    (["--decode-extra-config", '{"proxy_port": 4}'], "--decode-extra-config: proxy_port must be the same"),
    (["--decode-extra-config", '{"lese_s": 3}'], "--decode-extra-config: "),
    (["--decode-extra-config", '{"lease_s": -3}'], "--decode-extra-config: "),
    (["--prefill-extra-config", "[1]"], "--prefill-extra-config: expected a JSON object"),
    (["--prefill-extra-config", "{"], "--prefill-extra-config: not valid JSON"),
    (["--extra-config", '{"lease_s": "long"}'], "--extra-config: "),
])
def test_bad_role_extra_configs_are_refused_naming_the_option(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _extras(tmp_path, *argv)


def _vllm_argvs(tmp_path: Path, *argv: str) -> dict[str, list[str]]:
    """Each instance's vLLM arguments after the connector's config, by instance name."""
    args = build_parser().parse_args(["up", "--model", "m", "--prefill", "1", "--decode", "2", *argv])
    cluster, _ = build_cluster(args, "m", tmp_path)
    return {proc.name: proc.argv[proc.argv.index("--kv-transfer-config") + 2:]
            for proc in cluster.processes if proc.name != "proxy"}


def test_role_vllm_args_go_to_their_role_after_those_for_every_instance(tmp_path: Path) -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    argvs = _vllm_argvs(tmp_path, "--decode-vllm-args", f"--speculative-config '{spec}'",
                        "--prefill-vllm-args", "--max-num-batched-tokens 64", "--", "--seed", "7")
    assert argvs["prefill0"][-4:] == ["--seed", "7", "--max-num-batched-tokens", "64"]
    for name in ("decode0", "decode1"):
        assert argvs[name][-4:] == ["--seed", "7", "--speculative-config", spec]
    assert "--speculative-config" not in argvs["prefill0"]


def test_role_vllm_args_a_shell_could_not_split_are_refused_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--decode-vllm-args: No closing quotation"):
        _vllm_argvs(tmp_path, "--decode-vllm-args", "--speculative-config '{")


@pytest.mark.parametrize(("cached", "moved"), [(89, True), (0, False), (None, False)])
def test_the_demo_request_says_whether_its_kv_moved(cached: int | None, moved: bool) -> None:
    """The proxy's answer (a stub here: this checks how `p2pkv up` reads it) names the prompt tokens the decode
    instance found cached, those it loaded; none means the decode instance computed the prompt itself."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        usage: dict[str, Any] = {"prompt_tokens": 90, "completion_tokens": 16}
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return JSONResponse({"choices": [{"text": "abc"}], "usage": usage}, headers={TRANSFER_HEADER: "t-1"})

    with serve(app) as address:
        line, did_move = send_demo_request(f"http://{address}", "m")
    assert did_move is moved
    assert f"completion='abc' prompt_tokens=90 cached_on_decode={cached} transfer=t-1" in line


def test_a_chat_model_is_asked_the_demo_question_through_the_chat_api(tmp_path: Path) -> None:
    """A model whose tokenizer has a chat template (SmolLM2's) gets the question as a chat message; the line
    gives the question and the answer."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert has_chat_template(str(tmp_path)) and not has_chat_template(str(tmp_path / "none"))
    app = FastAPI()
    asked: list[dict[str, Any]] = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        asked.append(await request.json())
        usage = {"prompt_tokens": 40, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 39}}
        return JSONResponse({"choices": [{"message": {"role": "assistant", "content": " Paris. "}}], "usage": usage},
                            headers={TRANSFER_HEADER: "t-2"})

    with serve(app) as address:
        line, did_move = send_demo_request(f"http://{address}", "m", chat=True)
    assert did_move
    assert asked[0]["messages"] == [{"role": "user", "content": DEMO_QUESTION}]
    assert f"asked {DEMO_QUESTION!r}: answer='Paris.' prompt_tokens=40 cached_on_decode=39 transfer=t-2" in line


def test_refusals_the_proxy_lists_are_said_once_they_come() -> None:
    """After a demo request whose KV did not move, `p2pkv up` says what the proxy lists as refused (the decode
    instance refused the prefill worker: another layout), once a heartbeat has brought it."""
    app = FastAPI()
    asked: list[int] = []

    @app.get("/instances")
    async def instances() -> dict[str, Any]:
        asked.append(1)
        refused = [{"address": "127.0.0.1:7100", "reason": "KV layout mismatch: dtype", "paired_again_in_s": 59.0}]
        return {"instances": [{"role": "prefill", "address": "127.0.0.1:8100", "refused": []},
                              {"role": "decode", "address": "127.0.0.1:8200",
                               "refused": refused if len(asked) > 2 else []}]}

    with serve(app) as address:
        lines = listed_refusals(f"http://{address}", 10.0)
        assert lines == ["decode instance 127.0.0.1:8200 refused the KV worker at 127.0.0.1:7100: "
                         "KV layout mismatch: dtype"]
        assert len(asked) == 3
    assert listed_refusals("http://127.0.0.1:9", 0.0) == []  # no proxy there: nothing to say, no error


def test_with_the_prefix_policy_every_instance_publishes_its_kv_events_on_a_local_socket(tmp_path: Path) -> None:
    """`--prefill-policy prefix` (the default, or `--decode-only-below`): each instance gets vLLM's
    `--kv-events-config` with an ipc endpoint of its own (only this host can subscribe), and the proxy the policy;
    events configured by hand in the vLLM arguments are left as they are."""
    args = build_parser().parse_args(["up", "--model", "m", "--prefill", "2", "--prefill-policy", "prefix"])
    cluster, description = build_cluster(args, "m", tmp_path)
    endpoints = []
    for proc in cluster.processes:
        if proc.name == "proxy":
            assert proc.argv[proc.argv.index("--prefill-policy") + 1] == "prefix"
            continue
        config = json.loads(proc.argv[proc.argv.index("--kv-events-config") + 1])
        assert config["enable_kv_cache_events"] and config["publisher"] == "zmq"
        endpoints.append(config["endpoint"])
    # In a folder of their own, not among the logs (a socket's path is short; the logs hold logs only).
    folder = description["kv_events_dir"]
    assert len(set(endpoints)) == 3 and all(e.startswith(f"ipc://{folder}/") for e in endpoints)
    assert not folder.startswith(str(tmp_path)) and len(endpoints[0]) < 100
    args = build_parser().parse_args(["up", "--model", "m", "--decode-only-below", "64"])
    cluster, _ = build_cluster(args, "m", tmp_path)
    assert all("--kv-events-config" in proc.argv for proc in cluster.processes if proc.name != "proxy")
    own = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    args = build_parser().parse_args(["up", "--model", "m", "--prefill-policy", "prefix", "--", "--kv-events-config",
                                      own])
    cluster, _ = build_cluster(args, "m", tmp_path)
    assert all(proc.argv.count("--kv-events-config") == 1 and own in proc.argv
               for proc in cluster.processes if proc.name != "proxy")
    args = build_parser().parse_args(["up", "--model", "m"])  # prefix is the default
    assert all("--kv-events-config" in proc.argv for proc in build_cluster(args, "m", tmp_path)[0].processes
               if proc.name != "proxy")
    args = build_parser().parse_args(["up", "--model", "m", "--prefill-policy", "round-robin"])
    assert not any("--kv-events-config" in proc.argv for proc in build_cluster(args, "m", tmp_path)[0].processes)
