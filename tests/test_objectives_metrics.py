"""The metric parts of one loss call: every item becomes the float64 value of the tensor (or number)
an objective hands over, whatever its dtype, in one stack and one transfer."""
import math

import torch

from megapkl.objectives.metrics import _Builder, _max, _min


def reference(value) -> float:
    """What an item is worth: the number as a tensor on the device, cast to float64."""
    return torch.as_tensor(value).to(torch.float64).item()


def test_builder_items_are_their_float64_values():
    gen = torch.Generator().manual_seed(0)
    x32 = torch.randn(37, generator=gen) * 1e3
    mask = x32 > 0
    b = _Builder(torch.device("cpu"))
    b.add("total", "loss", x32[0])                      # float32 0-d
    b.mean("plain", x32)                                # float64 sum, count from the host
    b.mean("masked", x32, mask)                         # int64 count
    b.mean("flags", mask)                               # bool values
    b.add("value", "py_float", 0.1234567890123)         # a Python float joins as float32 did
    b.add("value", "py_int", 2**40 + 1)                 # a Python int stays exact
    b.add("value", "one_element", torch.tensor([2.5]))  # shape [1] is one value
    _max(b, "max", x32)
    _min(b, "min", x32[:0])                             # no tokens: +inf
    parts = b.build()
    assert parts.totals == {"loss": reference(x32[0])}
    assert parts.sums == {"plain": x32.double().sum().item(),
                          "masked": x32.double()[mask].sum().item(),
                          "flags": float(mask.sum())}
    assert parts.counts == {"plain": 37.0, "masked": float(mask.sum()), "flags": 37.0}
    assert parts.values == {"py_float": reference(0.1234567890123), "py_int": float(2**40 + 1),
                            "one_element": 2.5}
    assert parts.values["py_float"] != 0.1234567890123  # float32, as the stack always held it
    assert parts.maxes == {"max": reference(x32.max())}
    assert parts.mins == {"min": math.inf}
    assert all(type(v) is float for d in (parts.sums, parts.counts, parts.values) for v in d.values())


def test_builder_counts_beyond_float32_precision_round_as_before():
    """A count of elements was a float32 tensor: above 2^24 it is rounded the same way."""
    b = _Builder(torch.device("cpu"))
    b.mean("big", torch.zeros(2**24 + 1, dtype=torch.bool))
    assert b.build().counts["big"] == reference(torch.tensor(float(2**24 + 1))) == 2.0**24
