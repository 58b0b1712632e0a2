"""Plugin registration: the entry point, the attention-backend registry, the CLI choice, the version gate."""

from __future__ import annotations

import argparse
from importlib.metadata import entry_points

import pytest

from prefixattn.integrations.sglang import plugin
from prefixattn.integrations.sglang.version import (SUPPORTED_SGLANG_VERSION, UnsupportedSGLangVersion,
                                                    check_sglang_version)

pytestmark = pytest.mark.sglang


def test_entry_point_is_declared_in_sglangs_plugin_group():
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "prefixattn"]
    assert ep.load() is plugin.load


def test_load_registers_backend_and_cli_choice_once():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    plugin.load()
    plugin.load()  # idempotent
    assert ATTENTION_BACKENDS["prefixattn"] is plugin.create_prefixattn_backend
    assert ATTENTION_BACKEND_CHOICES.count("prefixattn") == 1


def test_sglangs_plugin_loader_makes_the_cli_accept_the_backend_and_policy():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # what launch_server / the scheduler processes run first: discovers our entry point
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--attention-backend", "prefixattn",
                              "--schedule-policy", "prefixattn"])
    assert args.attention_backend == "prefixattn" and args.schedule_policy == "prefixattn"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--schedule-policy", "no-such-policy"])


def test_factory_takes_mla_models_to_the_mla_backend():
    import types

    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    runner = types.SimpleNamespace(use_mla_backend=True, token_to_kv_pool=object())
    # The MLA backend reads SGLang's latent pool: an MHA pool (here: none) is refused, naming it.
    with pytest.raises(ValueError, match="token_to_kv_pool: expected SGLang's MLATokenToKVPool"):
        plugin.create_prefixattn_backend(runner)
    # SGLang's DeepSeek attention takes the absorbed form for every prefixattn batch (fresh prefills included).
    rule = AttentionBackendRegistry.get_handler("prefixattn")
    assert rule(None, None) == AttnForwardMethod.MLA


def test_version_gate():
    assert check_sglang_version() == SUPPORTED_SGLANG_VERSION
    with pytest.raises(UnsupportedSGLangVersion, match=r"expected version 0\.5\.23 .* got 0\.5\.24"):
        check_sglang_version("0.5.24")
