"""``python -m benchmarks.wins``: the rule that turns a GPU or TPU run into the wins
``"auto"`` acts on, checked on hand-made runs whose answer is counted by hand (the committed
wins against their own runs: ``tests/kernels/test_implementation.py``)."""

import json

import pytest

from benchmarks import wins

MIB = 2**20


def _ops_row(impl, dtype, n, mib, us, backend=None, kind="fwd+bwd"):
    return dict(
        impl=impl, kind=kind, dtype=dtype, features=n, size_mib=mib, x_bytes=int(mib * MIB),
        status="ok", median_s=us * 1e-6, uses_kernel=backend is not None,
        kernel_backends=[backend] if backend else [],
    )  # fmt: skip


def _run(times, steps=(), gemma=(), op="rms_norm"):
    """A run: ``times[(dtype, n)] = {impl: (us at 32 MiB, us at 256 MiB)}``, the kernel
    rows' backend from their name; ``steps``/``gemma``: (dtype or mode, d, {norm: ms})."""
    backend = {"[pallas]": "Mosaic GPU", "[triton]": "Triton", "[xla]": None}
    rows = [
        _ops_row(f"{op} {path}", dtype, n, mib, us, backend[path])
        for (dtype, n), by_path in times.items()
        for path, pair in by_path.items()
        for mib, us in zip((32, 256), pair, strict=True)
    ]
    rows.append(_ops_row(f"{op} [pallas]", "float32", 1024, 32, 1.0, "Mosaic GPU", kind="fwd"))
    step = [
        dict(norm=norm, dtype=dtype, d=d, mlp="swiglu", status="ok", median_s=ms * 1e-3)
        for dtype, d, by_norm in steps
        for norm, ms in by_norm.items()
    ]
    gem = [
        dict(norm=norm, mode=mode, status="ok", median_s=ms * 1e-3)
        for mode, _, by_norm in gemma
        for norm, ms in by_norm.items()
    ]
    sections = dict(ops=dict(command="python -m benchmarks ops --rounds 3 --out RESULTS",
                             commit="abc1234", results=rows))  # fmt: skip
    if step:
        sections["step"] = dict(results=step)
    if gem:
        sections["gemma"] = dict(results=gem)
    return dict(device="NVIDIA H100 80GB HBM3", platform="gpu", jax="0.12.0", sections=sections)


def _ranges(run, op="rms_norm"):
    return sorted(
        (w["backend"], tuple(w["dtypes"]), tuple(w["features"]))
        for w in wins.derive(run, "r.json")
        if w["op"] == op
    )


WIN, LOSS = {"[xla]": (10, 80), "[pallas]": (9, 70)}, {"[xla]": (10, 80), "[pallas]": (11, 70)}


def test_a_win_is_a_run_of_widths_won_at_every_size():
    """1024-4096 won at both sizes; 8192 lost at 32 MiB (won at 256: not a win); 16384
    won again: two ranges; the float32 row the same, so one entry for both dtypes."""
    times = {}
    for dtype in ("float32", "bfloat16"):
        times |= {(dtype, n): WIN for n in (1024, 2048, 4096, 16384)}
        times[dtype, 8192] = LOSS
    got = wins.derive(_run(times), "r.json")
    assert sorted((w["dtypes"], w["features"]) for w in got) == [
        (["float32", "bfloat16"], [1024, 4096]),
        (["float32", "bfloat16"], [16384, 16384]),
    ]
    first = next(w for w in got if w["features"] == [1024, 4096])
    assert first | dict(measured=None) == dict(
        op="rms_norm", backend="mosaic_gpu", platform="cuda", device_kind="H100",
        dtypes=["float32", "bfloat16"], features=[1024, 4096], smallest_bytes=32 * MIB,
        jax=["0.12.0"], results="r.json", command="python -m benchmarks ops --rounds 3",
        commit="abc1234", measured=None,
    )  # fmt: skip
    assert first["measured"].startswith("0.88-0.90x XLA forward+backward at 1024, 2048, 4096")


def test_the_fastest_backend_takes_each_width_and_a_change_ends_the_range():
    both = lambda p, t: {"[xla]": (10, 80), "[pallas]": p, "[triton]": t}
    times = {
        ("bfloat16", 1024): both((9, 70), (8, 60)),  # Triton's
        ("bfloat16", 2048): both((8, 60), (9, 70)),  # Mosaic GPU's
        ("bfloat16", 4096): both((8, 60), (12, 90)),  # Mosaic GPU's
    }
    assert _ranges(_run(times)) == [
        ("mosaic_gpu", ("bfloat16",), (2048, 4096)),
        ("triton", ("bfloat16",), (1024, 1024)),
    ]


def test_a_train_step_slower_with_the_kernels_takes_its_widths_out():
    """The pre-norm step at d 2048 bfloat16 slower with the kernels: 2048 is a loss and
    ends the bfloat16 range (float32 keeps its own); Gemma's step slower: 256 and 640;
    a tie is no faster."""
    times = {(d, n): WIN for d in ("float32", "bfloat16") for n in (128, 1024, 2048, 4096)}
    step = [("bfloat16", 2048, {"rms_norm [xla]": 60.0, "rms_norm [pallas]": 60.5})]
    assert _ranges(_run(times, steps=step)) == [
        ("mosaic_gpu", ("bfloat16",), (128, 1024)),
        ("mosaic_gpu", ("bfloat16",), (4096, 4096)),
        ("mosaic_gpu", ("float32",), (128, 4096)),
    ]
    faster = [("bfloat16", 2048, {"rms_norm [xla]": 60.0, "rms_norm [pallas]": 59.5})]
    assert _ranges(_run(times, steps=faster)) == [
        ("mosaic_gpu", ("float32", "bfloat16"), (128, 4096))
    ]
    gemma = [("scan", None, {"rms_norm [xla]": 40.0, "rms_norm [pallas]": 41.0})]
    assert _ranges(_run(times, gemma=gemma)) == [
        ("mosaic_gpu", ("bfloat16",), (128, 128)),
        ("mosaic_gpu", ("bfloat16",), (1024, 4096)),
        ("mosaic_gpu", ("float32",), (128, 4096)),
    ]
    # The fused add's kernels are not what the rms_norm step ran: its wins stand; a step
    # whose fused adds ran slower with them (float32, d 1024) takes 1024 out of its wins.
    add = _run(times, steps=step, op="add_rms_norm")
    assert _ranges(add, "add_rms_norm") == [("mosaic_gpu", ("float32", "bfloat16"), (128, 4096))]
    fused = [("float32", 1024, {"add_rms_norm [xla]": 60.0, "add_rms_norm [pallas]": 60.0})]
    add = _run(times, steps=step + fused, op="add_rms_norm")
    assert _ranges(add, "add_rms_norm") == [
        ("mosaic_gpu", ("bfloat16",), (128, 4096)),
        ("mosaic_gpu", ("float32",), (128, 128)),
        ("mosaic_gpu", ("float32",), (2048, 4096)),
    ]


def test_an_older_run_needs_what_it_did_not_record():
    run = _run({("float32", 1024): WIN})
    for r in run["sections"]["ops"]["results"]:
        r.pop("kernel_backends")
    with pytest.raises(SystemExit, match="--pallas-backend"):
        wins.derive(run, "r.json")
    assert wins.derive(run, "r.json", pallas_backend="triton")[0]["backend"] == "triton"
    del run["sections"]["ops"]["commit"]
    with pytest.raises(SystemExit, match="--commit"):
        wins.derive(run, "r.json", pallas_backend="triton")
    # No "[xla]" rows and "rms_norm" ran kernels: no XLA path to compare with.
    run = _run({("float32", 1024): WIN})
    for r in run["sections"]["ops"]["results"]:
        if r["impl"] == "rms_norm [xla]":
            r.update(impl="rms_norm", uses_kernel=True)
    with pytest.raises(SystemExit, match="no XLA path of rms_norm"):
        wins.derive(run, "r.json")


def test_a_step_is_read_against_xla_only():
    """A run from before the "[xla]" rows: its "rms_norm" step is the XLA path where "auto"
    ran no kernel in its ops, and no reference where it did."""
    times = {("bfloat16", n): WIN for n in (1024, 2048)}
    slower = [("bfloat16", 2048, {"rms_norm": 60.0, "rms_norm [pallas]": 61.0})]
    run = _run(times, steps=slower)
    assert _ranges(run) == [("mosaic_gpu", ("bfloat16",), (1024, 1024))]
    for r in run["sections"]["ops"]["results"]:
        if r["impl"] == "rms_norm [pallas]":
            run["sections"]["ops"]["results"].append(r | dict(impl="rms_norm"))
            break
    assert _ranges(run) == [("mosaic_gpu", ("bfloat16",), (1024, 2048))]


def test_update_replaces_the_same_device_and_jax_and_keeps_the_layout():
    text = wins.WINS_FILE.read_text()
    assert wins.update([], text) == text  # the committed file's own layout
    new = wins.derive(_run({("float32", 1024): WIN}), "r.json")
    data = json.loads(wins.update(new + new, text))
    assert data["wins"][-2:] == new + new and len(data["wins"]) == len(json.loads(text)["wins"]) + 2
    again = json.loads(wins.update(new, wins.update(new, text)))
    assert again["wins"][-1] == new[0] and len(again["wins"]) == len(data["wins"]) - 1
