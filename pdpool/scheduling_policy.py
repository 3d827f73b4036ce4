"""The pool's engines' scheduling policy: one rule for `pdpool up` (up/topology.py) and the
operator (operator/commands.py), so that both run the same pool the same way."""

from __future__ import annotations


def scheduling_args(has_tenants: bool) -> list[str]:
    """Engine flags for a pool with or without a tenants file. Flow control's bands mean
    something past the gateway only if the engines order their queues by the `priority`
    the front-ends write (sidecar/routing/tenants.engine_priority): with a tenants file the
    engines run vLLM's --scheduling-policy priority (pdpool serve and stock vLLM take the
    same flag); without one, vLLM's default, fcfs. Engine extra args come later and win."""
    return ["--scheduling-policy", "priority"] if has_tenants else []
