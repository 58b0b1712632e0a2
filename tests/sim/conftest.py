import dataclasses

import pytest

from prefixattn.sim.step_cost import CostModel
from prefixattn.sim.presets import get_hardware


@pytest.fixture(scope="session")
def cost():
    return CostModel("a100", "mistral-7b")


@pytest.fixture(scope="session")
def tight_cost():
    """An A100 with 22 GB: 1-5 GiB of KV after Mistral-7B's weights and activations, so a few dozen requests fill it and the
    policies must preempt / hold back."""
    hw = dataclasses.replace(get_hardware("a100"), name="a100-22gb", memory_bytes=22_000_000_000)
    return CostModel(hw, "mistral-7b")
