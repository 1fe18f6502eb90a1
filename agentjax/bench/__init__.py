"""Agent-traffic benchmarking: trace loaders, a synthetic session generator, AgentX metrics, costs.

Replays agent traces against a server and measures TPGS, interactivity and cost. The host-side
modules here (`traces`, `generate`, `metrics`, `cost`) never import jax.
"""
