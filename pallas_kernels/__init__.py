"""Attention and MoE kernels, each beside the pure-jnp reference it must match.

On CPU the runner uses the references; on GPU it picks the kernels. Tests compare the two in
interpret mode.
"""
