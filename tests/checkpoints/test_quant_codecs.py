"""checkpoints/quant_codecs.py: the published number formats decode exactly, and the host and a jitted step
decode the same stored bytes to the same float32 bits."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints import quant_codecs
from checkpoints.quant_codecs import Codec, dequantize, encode

RNG = np.random.default_rng(0)


def test_e2m1_codes_decode_to_the_ocp_values_and_unpack_low_nibble_first():
    codes = np.arange(16, dtype=np.uint8)
    want = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    packed = quant_codecs.pack_e2m1(codes[None, :])
    assert packed.shape == (1, 8) and packed[0, 0] == 0x10  # code 0 low, code 1 high
    np.testing.assert_array_equal(quant_codecs.decode_values(packed, Codec("e2m1")), want[None, :])
    # ml_dtypes' own float4_e2m1fn agrees on every code
    np.testing.assert_array_equal(codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32), want)


def test_e8m0_scales_are_exact_powers_of_two_including_the_smallest():
    raw = np.array([0, 1, 126, 127, 128, 254], np.uint8).view(quant_codecs.E8M0)
    got = raw.astype(np.float32)
    np.testing.assert_array_equal(got, np.exp2(np.array([-127, -126, -1, 0, 1, 127], np.float64)).astype(np.float32))


@pytest.mark.parametrize("kind, block", [("fp8", (16, 16)), ("fp8_ue8m0", (32, 16)), ("mxfp8", None),
                                         ("mxfp4", None), ("nvfp4", None)])
def test_encoded_weights_decode_close_to_the_original_and_identically_on_host_and_device(kind, block):
    w = (RNG.standard_normal((40, 96)) * 0.05).astype(np.float32)
    values, scales, glob = encode(w, kind, block or (128, 128))
    codec = {"fp8": Codec("e4m3", "f32", block), "fp8_ue8m0": Codec("e4m3", "e8m0", block),
             "mxfp8": Codec("e4m3", "e8m0", (1, 32)), "mxfp4": Codec("e2m1", "e8m0", (1, 32)),
             "nvfp4": Codec("e2m1", "e4m3", (1, 16), global_scale=True)}[kind]
    assert scales.shape == codec.scale_shape(w.shape) and values.shape == codec.value_shape(w.shape)
    host = dequantize(values, scales, None if glob is None else glob.reshape(1, 1), codec)
    tolerance = {"fp8": 0.07, "fp8_ue8m0": 0.07, "mxfp8": 0.15,  # OCP MX clamps past 448
                 "mxfp4": 0.3, "nvfp4": 0.3}[kind]
    assert np.abs(host - w).max() <= tolerance * np.abs(w).max()
    device = jax.jit(lambda v, s, g: dequantize(v, s, g, codec, jnp))(values, scales, glob if glob is None else
                                                                       glob.reshape(1, 1))
    np.testing.assert_array_equal(np.asarray(device).view(np.uint32), host.view(np.uint32))


def test_a_transposed_codec_decodes_the_transposed_matrix():
    w = (RNG.standard_normal((32, 64)) * 0.1).astype(np.float32)
    values, scales, _ = encode(w, "mxfp4")
    codec = Codec("e2m1", "e8m0", (1, 32))
    straight = dequantize(values, scales, None, codec)
    # the transposed bytes hold their E2M1 pairs along the rows: the swapped codec reads them so
    swapped = dequantize(np.ascontiguousarray(values.T), np.ascontiguousarray(scales.T), None, codec.swapped())
    np.testing.assert_array_equal(swapped, straight.T)
