"""LayerSpec: derived sizes, normalisation of its fields, and validation."""

import dataclasses

import pytest

from conv2d import Activation, DType, LayerSpec, Normalization

BASE = dict(batch_size=2, in_height=8, in_width=6, in_channels=3, out_channels=4)


@pytest.mark.parametrize("kernel, stride, padding, out_hw", [
    (3, 1, 1, (8, 6)),
    (3, 2, 0, (3, 2)),
    ((3, 1), (2, 1), (1, 0), (4, 6)),
    (8, 4, 2, (2, 1)),
    (1, 1, 0, (8, 6)),
])
def test_output_size_is_floor_of_padded_extent_over_stride(kernel, stride, padding, out_hw):
    spec = LayerSpec(**BASE, kernel=kernel, stride=stride, padding=padding)
    assert (spec.out_height, spec.out_width) == out_hw
    assert spec.output_shape == (2, *out_hw, 4)


def test_int_and_pair_fields_are_stored_as_pairs():
    a = LayerSpec(**BASE, kernel=3, stride=2, padding=1)
    b = LayerSpec(**BASE, kernel=(3, 3), stride=[2, 2], padding=(1, 1))
    assert a == b and a.kernel == (3, 3) and a.stride == (2, 2) and a.padding == (1, 1)


def test_names_become_enums():
    spec = LayerSpec(**BASE, activation="gelu", normalization="layer_norm", dtype="bfloat16")
    assert spec.activation is Activation.GELU
    assert spec.normalization is Normalization.LAYER_NORM
    assert spec.dtype is DType.BFLOAT16


def test_spec_is_frozen_and_hashable():
    spec = LayerSpec(**BASE)
    assert hash(spec) == hash(LayerSpec(**BASE))
    assert {spec: 1}[LayerSpec(**BASE)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.batch_size = 3


def test_replace_validates_again():
    spec = LayerSpec(**BASE)
    assert dataclasses.replace(spec, dtype="float16").dtype is DType.FLOAT16
    with pytest.raises(ValueError, match="bn_momentum"):
        dataclasses.replace(spec, bn_momentum=2.0)


def test_to_dict_round_trips():
    spec = LayerSpec(**BASE, kernel=(3, 1), stride=2, activation="relu", normalization="batch_norm",
                     bn_momentum=0.2, bn_epsilon=1e-3, dtype="float16")
    assert LayerSpec.from_dict(spec.to_dict()) == spec


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown fields.*padding_value"):
        LayerSpec.from_dict({**LayerSpec(**BASE).to_dict(), "padding_value": 1.0})


@pytest.mark.parametrize("changes, field, rule", [
    (dict(batch_size=0), "batch_size", ">= 1"),
    (dict(in_height=-1), "in_height", ">= 1"),
    (dict(in_width=2.0), "in_width", "int"),
    (dict(in_channels=True), "in_channels", "int"),
    (dict(out_channels=0), "out_channels", ">= 1"),
    (dict(kernel=0), "kernel", ">= 1"),
    (dict(kernel=(3, 3, 3)), "kernel", "pair"),
    (dict(kernel=9), "kernel", "larger than the padded input"),
    (dict(kernel=(3, 9), padding=1), "kernel", "width 9 is larger"),
    (dict(stride=0), "stride", ">= 1"),
    (dict(padding=-1), "padding", ">= 0"),
    (dict(activation="swish"), "activation", "one of"),
    (dict(normalization="group_norm"), "normalization", "one of"),
    (dict(dtype="int8"), "dtype", "one of"),
    (dict(bn_momentum=1.5), "bn_momentum", r"\[0, 1\]"),
    (dict(bn_momentum=-0.1), "bn_momentum", r"\[0, 1\]"),
    (dict(bn_epsilon=0.0), "bn_epsilon", "> 0"),
    (dict(bn_epsilon=float("nan")), "bn_epsilon", "> 0"),
    (dict(bn_epsilon=float("inf")), "bn_epsilon", "finite"),
])
def test_invalid_field_raises_value_error_naming_field_value_and_rule(changes, field, rule):
    with pytest.raises(ValueError, match=rf"LayerSpec\.{field}:.*{rule}") as info:
        LayerSpec(**{**BASE, **changes})
    assert repr(next(iter(changes.values()))) in str(info.value) or "larger" in str(info.value)


@pytest.mark.parametrize("field, value, activation", [("negative_slope", 0.2, "relu"), ("elu_alpha", 0.5, "gelu"),
                                                      ("negative_slope", 0.2, "elu"), ("elu_alpha", 0.5, "leaky_relu")])
def test_an_activation_parameter_is_refused_beside_another_activation(field, value, activation):
    with pytest.raises(ValueError, match=f"LayerSpec.{field}: only activation="):
        LayerSpec(in_height=4, in_width=4, in_channels=1, out_channels=1, activation=activation, **{field: value})


@pytest.mark.parametrize("field", ["negative_slope", "elu_alpha"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), True, "0.1"])
def test_an_activation_parameter_is_a_finite_number(field, value):
    activation = "leaky_relu" if field == "negative_slope" else "elu"
    with pytest.raises(ValueError, match=f"LayerSpec.{field}: expected a finite number"):
        LayerSpec(in_height=4, in_width=4, in_channels=1, out_channels=1, activation=activation, **{field: value})


def test_the_activation_parameter_is_leaky_relus_slope_or_elus_alpha():
    base = dict(in_height=4, in_width=4, in_channels=1, out_channels=1)
    assert LayerSpec(**base, activation="leaky_relu", negative_slope=0.2).activation_parameter == 0.2
    assert LayerSpec(**base, activation="elu", elu_alpha=0.7).activation_parameter == 0.7
    assert LayerSpec(**base, activation="relu").activation_parameter is None


@pytest.mark.parametrize("groups", [0, 2, 3, True])
def test_groups_must_divide_both_channel_counts(groups):
    # BASE-like: 4 input channels, 6 output: 2 divides both, 3 only the output's
    with pytest.raises(ValueError, match="LayerSpec.groups: expected an int >= 1 that divides"):
        LayerSpec(in_height=6, in_width=6, in_channels=4 if groups != 2 else 3, out_channels=6, groups=groups)


def test_dilation_spreads_the_kernel_in_the_output_size_and_the_fit():
    spec = LayerSpec(in_height=9, in_width=9, in_channels=1, out_channels=1, kernel=3, dilation=(2, 4))
    assert (spec.out_height, spec.out_width) == (5, 1)  # extents 5 and 9
    with pytest.raises(ValueError, match=r"the kernel's width 3 \(dilated by 5: 11\) is larger"):
        LayerSpec(in_height=9, in_width=9, in_channels=1, out_channels=1, kernel=3, dilation=(1, 5))


def test_grouped_weights_have_in_channels_over_groups():
    spec = LayerSpec(in_height=6, in_width=6, in_channels=4, out_channels=8, kernel=3, groups=4)
    assert spec.weight_shape == (8, 3, 3, 1) and spec.fan_in == 9


@pytest.mark.parametrize("fields, message", [
    (dict(bn_affine=False), "LayerSpec.bn_affine: False means a norm without gamma and beta; this layer has no norm"),
    (dict(normalization="layer_norm", bn_track_running_stats=False),
     "LayerSpec.bn_track_running_stats: only batch norm keeps running statistics")])
def test_norm_options_are_refused_where_there_is_nothing_to_apply_them_to(fields, message):
    with pytest.raises(ValueError, match=message):
        LayerSpec(in_height=4, in_width=4, in_channels=1, out_channels=1, **fields)


def test_batch_norm_without_running_statistics_uses_the_batchs_in_evaluation():
    spec = LayerSpec(in_height=4, in_width=4, in_channels=1, out_channels=1, normalization="batch_norm",
                     bn_track_running_stats=False)
    assert spec.batch_statistics(training=False)


@pytest.mark.parametrize("fields, message", [
    (dict(padding="full"), r"LayerSpec.padding: expected an int, a pair, 'same', 'valid' or \(\(top, bottom\)"),
    (dict(padding="same", stride=2), "LayerSpec.padding: 'same' needs stride 1"),
    (dict(padding="same", padding_end=1), "LayerSpec.padding_end: given beside padding='same'"),
    (dict(padding=((1, -1), (0, 0))), "LayerSpec.padding_end: expected every entry >= 0"),
    (dict(padding=1, padding_mode="mirror"), "LayerSpec.padding_mode: expected one of"),
    (dict(padding=4, padding_mode="reflect"), "padding_mode='reflect' needs padding < the input's height 4"),
    (dict(padding=5, padding_mode="circular"), "padding_mode='circular' needs padding <= the input's height 4"),
    (dict(dilation=0), "LayerSpec.dilation: expected every entry >= 1")])
def test_bad_padding_and_dilation_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        LayerSpec(in_height=4, in_width=4, in_channels=1, out_channels=1, **fields)
