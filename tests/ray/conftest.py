"""Ray Data suite (marker ``ray``): runs in ``.venv-ray`` via ``scripts/test_ray.sh``; ``test_vllm_engine.py``
(marker ``vllm``, no ray needed) runs in ``.venv-vllm`` via ``scripts/test_vllm.sh``; ``test_vllm_ray.py`` (markers
``ray``, ``vllm``, ``slow``) needs both and runs in ``.venv-vllm`` with ``PREFIXATTN_RAY_VLLM=1 scripts/test_ray.sh``
(which puts ray[data] there).

Without ray installed (the main venv) the modules that import it are not collected (the main suite also deselects
``-m "not ray"``); ``test_ray_installed.py`` is always collected, so ``pytest -m ray`` in a venv without ray fails
instead of passing with nothing run. One local in-process cluster per module (2 CPUs: the machine is shared), shut
down after it.
"""

import importlib.util
import os

import pytest

HAS_RAY = importlib.util.find_spec("ray") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# test_vllm_engine.py needs vllm (not ray): it runs in the vLLM venv; everything else needs ray
collect_ignore_glob = (([] if HAS_RAY else ["test_pipeline.py", "test_prepass.py"]) +
                       ([] if HAS_VLLM else ["test_vllm_engine.py"]) +
                       ([] if HAS_RAY and HAS_VLLM else ["test_vllm_ray.py"]))

#: CPUs of the local cluster, and of each replica actor (fractional: 2-4 actors share the 2 CPUs).
CLUSTER_CPUS = 2
ACTOR_CPUS = 0.5


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here) and "vllm" not in item.keywords:
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    from ray.data import DataContext

    # workers import the test modules' engines by reference: give them the repository on their path
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(num_cpus=CLUSTER_CPUS, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root, "TRITON_INTERPRET": "1"}})
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    yield ray
    ray.shutdown()
