"""``python -m benchmarks`` for every compile target that ``rmsnorm_jax.aot`` names, and
where ``ops`` shows a bound.

``estimates --quick`` runs once per target family: TPU here (``tpu-v5e``, where issue 35
saw a ``ZeroDivisionError``: a TPU compiler can keep a small step's temporaries on chip,
leaving 0 bytes in HBM to compare with), GPU in test_bench.py (``h100``). Targets without
a cost model are refused, naming why and what works for them.
"""

import json

import pytest
from helpers import deviceless_skip_reason, requires_deviceless

import benchmarks.__main__ as cli
from benchmarks import estimates, ops, report
from rmsnorm_jax import aot

TPUS = [name for name in aot.target_names() if name.startswith("tpu")]
WITHOUT_COST_MODEL = ("cpu", "a100")


def test_every_target_is_a_tpu_a_gpu_or_without_a_cost_model():
    """The families below cover aot.target_names(): a new name needs its own test."""
    assert set(aot.target_names()) == {*TPUS, "h100", *WITHOUT_COST_MODEL}


def test_a_ratio_over_nothing_is_none():
    assert estimates.ratio(3.0, 2.0) == 1.5
    assert estimates.ratio(0, 0) is None and estimates.ratio(5, 0) is None
    assert estimates.ratio(None, 2.0) is None and estimates.ratio(1.0, None) is None


@pytest.fixture(scope="module")
def tpu_estimates(tmp_path_factory):
    out = tmp_path_factory.mktemp("tpu")
    argv = ["estimates", "--quick", "--target", "tpu-v5e", "--dtypes", "bfloat16"]
    return cli.main([*argv, "--out", str(out)]), out


@requires_deviceless("tpu-v5e")
def test_quick_estimates_for_a_tpu(tpu_estimates):
    rep, out = tpu_estimates
    stem = "tpu-v5e_2x2"
    for name in (f"{stem}.md", f"{stem}-summary.md", f"{stem}-fused.md"):
        text = (out / name).read_text()
        assert report.SMOKE in text and "not a hardware timing" in text, name
        assert "python -m benchmarks estimates --quick --target tpu-v5e" in text
    saved = json.loads((out / f"{stem}.json").read_text())
    assert saved["unit"] == "cycles" and saved["target"] == "tpu-v5e:2x2"
    for r in rep["results"]:
        assert r["fwd"] > 0 and r["fwd_bwd"] > 0 and r["dtype"] == "bfloat16"
    assert {r["dtype"] for r in rep["step_cost"]} == {"bfloat16"}  # --dtypes reaches it
    flax = next(r["temp_bytes"] for r in rep["memory"] if r["norm"] == "flax RMSNorm")
    for r in rep["memory"]:
        assert r["temp_bytes"] >= 0
        assert r["vs_flax"] == (r["temp_bytes"] / flax if flax else None)


@pytest.mark.parametrize("name", WITHOUT_COST_MODEL)
@pytest.mark.parametrize("section", ["estimates", "gemma", "maxtext"])
def test_a_target_without_a_cost_model_is_refused_saying_what_works(name, section, capsys):
    if reason := deviceless_skip_reason(name):
        pytest.skip(reason)
    with pytest.raises(SystemExit) as refused:
        cli.main([section, "--quick", "--target", name])
    message = str(refused.value)
    assert f"no cost model for {name}" in message
    assert f"examples/train_lm.py --compile-for {name}" in message
    assert all(tpu in message for tpu in TPUS) and "h100" in message


def test_ops_shows_a_bound_only_in_full_runs_on_a_gpu_or_tpu():
    assert ops.shows_bound("gpu", quick=False) and ops.shows_bound("tpu", quick=False)
    assert not ops.shows_bound("cpu", quick=False)  # the copy's rate is no bound there
    assert not ops.shows_bound("gpu", quick=True)
