"""Scheduling policies of the simulated systems and their registry (:func:`make_policy`, :func:`policy_names`)."""

from prefixattn.sim.policies.base import Policy
from prefixattn.sim.policies.registry import make_policy, policy_help, policy_names, register
from prefixattn.sim.policies import engines, scheduled  # noqa: F401 (the built-in policies register themselves)

__all__ = ["Policy", "make_policy", "policy_help", "policy_names", "register"]
