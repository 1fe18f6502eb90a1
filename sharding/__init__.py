"""Parallel layouts as explicit `shard_map` meshes: axis roles and settings (mesh.py), parameter layouts
and the rules table (layouts.py), the per-device model (modules.py), the layout's attention ops
(attention.py), collectives by role (collectives.py), the sharded step (step.py), several processes
(distributed.py), and the collectives a step runs (hlo_collectives.py, collective_formulas.py)."""
