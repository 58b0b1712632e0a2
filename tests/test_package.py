"""The package's import surface: the public names resolve, and importing a subpackage imports only what it needs."""

import importlib
import json
import subprocess
import sys

import pytest

import prefixattn


def test_every_public_name_resolves_to_its_module():
    assert set(prefixattn.__all__) == set(prefixattn._EXPORTS) | {"__version__"}
    for name, module in prefixattn._EXPORTS.items():
        value = getattr(prefixattn, name)
        assert getattr(sys.modules[module], name) is value, name
    # A submodule, as an eager import offered it (called directly: an imported one is an attribute already).
    assert prefixattn.__getattr__("planner") is importlib.import_module("prefixattn.planner")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        prefixattn.no_such_name  # noqa: B018


@pytest.mark.parametrize("module", ["prefixattn.integrations.vllm.plugin", "prefixattn.integrations.sglang",
                                    "prefixattn.integrations.ray", "prefixattn.scheduling"])
def test_a_subpackage_imports_neither_torch_nor_triton(module):
    # vLLM imports its plugin in every process it starts; the scheduler is numpy-only.
    code = (f"import json, sys; import {module}\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []
