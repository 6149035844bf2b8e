"""The slow-link and slow-data faults: parsing, and which rank each one slows."""

from __future__ import annotations

import pytest

from parwatch.trainer.errors import ConfigError
from parwatch.trainer.faults import Faults, parse_fault


def test_slow_link_delays_only_the_named_direction():
    fault = parse_fault("slow-link:src=0,dst=2,ms=20")
    assert fault.params == {"src": 0, "dst": 2, "ms": 20.0}
    assert Faults([fault], rank=0, stage=0).link_delays_ms() == {2: 20.0}
    assert Faults([fault], rank=2, stage=1).link_delays_ms() == {}  # the way back is healthy


def test_slow_data_slows_one_rank():
    fault = parse_fault("slow-data:rank=1,ms=7.5")
    assert Faults([fault], rank=1, stage=0).data_delay_ms() == 7.5
    assert Faults([fault], rank=0, stage=0).data_delay_ms() == 0.0


@pytest.mark.parametrize(
    "spec,message",
    [
        ("slow-link:src=1,dst=1,ms=5", "two different ranks"),
        ("slow-link:src=0,dst=1", "missing ms"),
        ("slow-link:src=0,dst=1,ms=-1", "ms must be >= 0"),
        ("slow-data:rank=0,ms=x", "not a float"),
        ("slow-data:ms=3", "missing rank"),
    ],
)
def test_bad_specs_name_the_field(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_fault(spec)
