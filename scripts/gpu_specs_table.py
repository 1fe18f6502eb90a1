"""Print the GPU spec table of the planning simulator (agentjax/bench/gpus.py) as Markdown: the figures
per GPU, then each figure's public source. BENCHMARKS.md carries its output (a test keeps them equal).

    python scripts/gpu_specs_table.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentjax.bench.gpus import spec_table  # noqa: E402

if __name__ == "__main__":
    sys.stdout.write(spec_table())
