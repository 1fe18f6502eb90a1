"""Converted-weights cache entries record checksums at save time; a changed byte fails restore by name."""
from __future__ import annotations

import json

import numpy as np
import pytest

from agentjax.errors import CorruptCheckpointError
from agentjax.models import PRESETS
from checkpoints.integrity import manifest, verify_arrays
from checkpoints.orbax_io import CHECKSUMS_FILE, restore_params, save_params


def _arrays():
    rng = np.random.default_rng(0)
    return {"embed": rng.standard_normal((64, 8)).astype(np.float32),
            "layers.0.attn.q_proj.kernel": rng.standard_normal((8, 8)).astype(np.float32),
            "final_norm.weight": np.ones(8, np.float32)}


def test_verification_passes_on_the_recorded_arrays():
    arrays = _arrays()
    verify_arrays(manifest(arrays, "{}"), arrays, "entry")


def test_one_changed_value_fails_and_names_the_array():
    arrays = _arrays()
    recorded = manifest(arrays, "{}")
    arrays["layers.0.attn.q_proj.kernel"][3, 5] += 1e-6
    with pytest.raises(CorruptCheckpointError,
                       match=r"entry: 1 arrays fail verification: layers\.0\.attn\.q_proj\.kernel has CRC-32"):
        verify_arrays(recorded, arrays, "entry")


def test_missing_array_and_changed_shape_are_named():
    arrays = _arrays()
    recorded = manifest(arrays, "{}")
    del arrays["embed"]
    arrays["final_norm.weight"] = np.ones(9, np.float32)
    with pytest.raises(CorruptCheckpointError, match=r"2 arrays fail.*embed is missing.*"
                                                     r"final_norm\.weight is float32\[9\], recorded float32\[8\]"):
        verify_arrays(recorded, arrays, "entry")


def test_restore_verifies_what_save_recorded(tmp_path):
    cfg, arrays = PRESETS["tiny-sliding"], _arrays()
    save_params(tmp_path / "entry", cfg, arrays)
    restored_cfg, restored = restore_params(tmp_path / "entry")
    assert restored_cfg == cfg and all(np.array_equal(restored[k], v) for k, v in arrays.items())


def test_restore_rejects_an_entry_whose_recorded_checksum_differs(tmp_path):
    save_params(tmp_path / "entry", PRESETS["tiny-sliding"], _arrays())
    checksums = tmp_path / "entry" / CHECKSUMS_FILE
    recorded = json.loads(checksums.read_text())
    recorded["arrays"]["embed"]["crc32"] ^= 1
    checksums.write_text(json.dumps(recorded))
    with pytest.raises(CorruptCheckpointError,
                       match=r"cache entry entry: 1 arrays fail verification: embed has CRC-32"):
        restore_params(tmp_path / "entry")
    restore_params(tmp_path / "entry", verify=False)  # the data itself still reads


def test_restore_rejects_an_edited_config(tmp_path):
    save_params(tmp_path / "entry", PRESETS["tiny-sliding"], _arrays())
    config = tmp_path / "entry" / "config.json"
    fields = json.loads(config.read_text())
    fields["rms_norm_eps"] *= 10
    config.write_text(json.dumps(fields))
    with pytest.raises(CorruptCheckpointError, match="config.json does not match its recorded checksum"):
        restore_params(tmp_path / "entry")


def test_entry_without_checksums_is_not_trusted(tmp_path):
    save_params(tmp_path / "entry", PRESETS["tiny-sliding"], _arrays())
    (tmp_path / "entry" / CHECKSUMS_FILE).unlink()
    with pytest.raises(CorruptCheckpointError, match="has no checksums.json"):
        restore_params(tmp_path / "entry")
