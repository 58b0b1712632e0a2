"""Scheduling policies of the simulated systems and their registry (:func:`make_policy`, :func:`policy_names`)."""

from prefixattn.sim.policies.base import Policy, make_policy, policy_help, policy_names, register

__all__ = ["Policy", "make_policy", "policy_help", "policy_names", "register"]
