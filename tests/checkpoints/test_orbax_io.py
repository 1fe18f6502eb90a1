"""The orbax cache restores converted parameters bit-exactly."""
from __future__ import annotations

import numpy as np

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
