"""The quick form (`kvgate serve --upstream URL`) in front of a vLLM started with `--api-key`:
the log said "set the pool's api_key_env to its --api-key", but the quick form dropped every
`KVGATE_POOLS__*` variable, so `KVGATE_POOLS__DEFAULT__API_KEY_ENV` was ignored without a word
and every request got 503 ("no replica has answered yet"). Its pool's own settings now come
from `KVGATE_POOLS__DEFAULT__*`; its replicas stay the flag's, and the pools and models
variables it does not read are named in a warning at start."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from gateway.cli.serve import start_warnings
from gateway.config import load_config
from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

KEY = "replica-key-0123456789"


def test_the_quick_forms_pool_takes_its_settings_from_the_environment() -> None:
    cfg = load_config("", quick=True, overrides={"pools": {"default": {
        "replicas": ["http://127.0.0.1:9"]}}, "models": {}}, environ={
        "KVGATE_POOLS__DEFAULT__API_KEY_ENV": "VLLM_KEY",
        "KVGATE_POOLS__DEFAULT__REPLICAS": "[http://127.0.0.1:7]",  # the flag's win
        "KVGATE_POOLS__OTHER__REPLICAS": "[http://127.0.0.1:8]"})  # one pool: the flag's
    assert list(cfg.pools) == ["default"]
    assert cfg.pools["default"].api_key_env == "VLLM_KEY"
    assert cfg.pools["default"].replicas == ["http://127.0.0.1:9"]


def test_a_keyed_replica_serves_through_the_quick_form(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, url = sim_factory("--time-scale", "50", "--api-key", KEY, model="keyed")
    gw, base = gateway_proc(upstreams=[url], env={
        "KVGATE_POOLS__DEFAULT__API_KEY_ENV": "VLLM_KEY", "VLLM_KEY": KEY})
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="keyed", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert reply.model == "keyed"


def test_the_pools_and_models_variables_the_quick_form_leaves_unread_are_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """They were dropped without a word (a user's KVGATE_POOLS__FP8__API_KEY_ENV did nothing)."""
    for name, value in (("KVGATE_POOLS__FP8__API_KEY_ENV", "K"), ("KVGATE_MODELS__M", "{}"),
                        ("KVGATE_POOLS__DEFAULT__REPLICAS", "[http://127.0.0.1:7]"),
                        ("KVGATE_POOLS__DEFAULT__API_KEY_ENV", "K"), ("K", "x")):
        monkeypatch.setenv(name, value)
    quick = load_config("", quick=True, overrides={"pools": {"default": {
        "replicas": ["http://127.0.0.1:9"]}}, "models": {}})
    named = [line.split()[2] for line in start_warnings(quick) if "--upstream" in line]
    assert named == ["KVGATE_MODELS__M", "KVGATE_POOLS__DEFAULT__REPLICAS",
                     "KVGATE_POOLS__FP8__API_KEY_ENV"]
    monkeypatch.setenv("KVGATE_POOLS__FP8__REPLICAS", "[http://127.0.0.1:8]")
    monkeypatch.delenv("KVGATE_MODELS__M")
    full = load_config("", overrides={"models": {}})  # not the quick form: they are read
    assert not [line for line in start_warnings(full) if "--upstream" in line]
