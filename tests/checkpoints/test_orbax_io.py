"""The orbax cache restores converted parameters bit-exactly; a truncated or missing file is one clear
error, and a restore orbax fails prints no tracebacks from its leftover reads."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agentjax.models import PRESETS
from agentjax.models.params import arrays_from_params, params_from_arrays, random_params
from checkpoints.orbax_io import restore_params, save_params


def test_round_trip_is_bit_exact(tmp_path):
    cfg = PRESETS["tiny-sliding"]
    arrays = arrays_from_params(cfg, random_params(cfg, seed=3))
    save_params(tmp_path / "entry", cfg, arrays)
    restored_cfg, restored = restore_params(tmp_path / "entry")
    assert restored_cfg == cfg
    assert restored.keys() == arrays.keys()
    for name, value in arrays.items():
        assert restored[name].dtype == value.dtype
        np.testing.assert_array_equal(restored[name], value)
    params_from_arrays(restored_cfg, restored)  # the restored dict builds the model's state


def test_real_model_round_trip_is_bit_exact(tmp_path):
    from checkpoints.embedded import smollm2_path
    from checkpoints.gguf import load_gguf

    cfg, arrays, _ = load_gguf(smollm2_path())
    save_params(tmp_path / "smol", cfg, arrays)
    restored_cfg, restored = restore_params(tmp_path / "smol")
    assert restored_cfg == cfg
    assert all(np.array_equal(restored[k], v) for k, v in arrays.items())


def _largest_file(entry):
    return max((p for p in (entry / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_a_truncated_or_missing_file_fails_with_one_clear_error_before_orbax_reads(tmp_path):
    from agentjax.errors import CorruptCheckpointError

    cfg = PRESETS["tiny-sliding"]
    arrays = arrays_from_params(cfg, random_params(cfg, seed=3))
    save_params(tmp_path / "entry", cfg, arrays)
    largest = _largest_file(tmp_path / "entry")
    size = largest.stat().st_size
    with largest.open("r+b") as file:
        file.truncate(size // 2)
    with pytest.raises(CorruptCheckpointError, match=rf"1 files are truncated or missing: .*{largest.name} has "
                                                     rf"{size // 2} bytes, recorded {size}"):
        restore_params(tmp_path / "entry")
    largest.unlink()
    with pytest.raises(CorruptCheckpointError, match=rf"{largest.name} is missing"):
        restore_params(tmp_path / "entry")


ORPHANED_READS = """
import json, sys, time
from pathlib import Path
from checkpoints.embedded import smollm2_path
from checkpoints.gguf import load_gguf
from checkpoints.orbax_io import restore_params, save_params
entry = Path(sys.argv[1])
cfg, arrays, _ = load_gguf(smollm2_path())
save_params(entry, cfg, arrays)
recorded = json.loads((entry / "checksums.json").read_text())
del recorded["files"]  # an entry written before file sizes were recorded: orbax itself meets the cut
(entry / "checksums.json").write_text(json.dumps(recorded))
largest = max((p for p in (entry / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
with largest.open("r+b") as file:
    file.truncate(largest.stat().st_size // 3)
try:
    restore_params(entry)
except Exception as error:
    print("restore failed:", type(error).__name__, file=sys.stderr)
time.sleep(3)  # the reads orbax had started finish after it gave up
"""


@pytest.mark.slow
def test_a_restore_that_orbax_fails_prints_no_event_loop_tracebacks(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ORPHANED_READS, str(tmp_path / "smol")], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert "restore failed: ValueError" in done.stderr, done.stderr[-2000:]
    assert "Event loop is closed" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
