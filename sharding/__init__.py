"""Parallel layouts as explicit `shard_map` meshes: axis roles and settings (mesh.py), parameter layouts
and the rules table (layouts.py), the per-device model (modules.py), the layout's attention ops
(attention.py), and collectives by role (collectives.py). The runtime that runs a layout (the sharded step,
several processes) is the runner's (agentjax/runner/sharded_step.py, distributed.py), and counting the
collectives a step runs is bench's (agentjax/bench/hlo_collectives.py, collective_formulas.py); nothing here
imports the runner, the engine or bench."""
