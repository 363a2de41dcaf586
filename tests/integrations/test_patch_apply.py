"""What ``integrations._patch.apply`` remembers between calls: which replacement makers
passed their probe (a patch in a ``with`` block per test probes once per process)."""

import functools

from rmsnorm_jax.integrations._patch import _maker_key


def _make(flavour, original, implementation, counter):
    return original


def _other(flavour, original, implementation, counter):
    return original


def test_a_maker_is_named_by_its_function_and_a_partial_by_its_arguments_too():
    # patch_tunix and patch_gemma build one replacement per semantics with functools.partial
    # (which has no __qualname__): a new partial each call names the same maker.
    assert _maker_key(_make) == (__name__, "_make")
    same = [functools.partial(_make, "x"), functools.partial(_make, "x")]
    assert _maker_key(same[0]) == _maker_key(same[1])
    assert hash(_maker_key(same[0])) == hash(_maker_key(same[1]))
    different = {
        _maker_key(functools.partial(_make, "x")),
        _maker_key(functools.partial(_make, "self")),
        _maker_key(functools.partial(_other, "x")),
        _maker_key(functools.partial(_make, flavour="x")),
        _maker_key(_make),
    }
    assert len(different) == 5
