"""What a device visit brings back besides its tables: ``ops``' plot (GB/s against features,
one line per norm, tokamax's among them, the copy's rate a line), drawn from a small results
file as ``python -m benchmarks.plot`` draws it; the command that draws it elsewhere where
matplotlib is missing; reports written whole or not at all; the kernels' backend named."""

import json
import sys
import types

import pytest

from benchmarks import ops, plot, report, timing

MIB = 32
X_BYTES = MIB * 2**20


def _row(impl, kind, features, dtype, us, role="ours", status="ok", note=""):
    moves = {"copy baseline": 2}.get(impl) or (2 if kind == "fwd" else 5)
    row = dict(section="ops", impl=impl, kind=kind, group="norm", role=role, size_mib=MIB)
    row |= dict(features=features, dtype=dtype, x_bytes=X_BYTES, moves=moves, status=status)
    return row | (dict(median_s=us * 1e-6) if status == "ok" else dict(note=note))


def _section() -> dict:
    """Two widths, two dtypes, forward and forward+backward: the copy, ours, tokamax's XLA
    path measured and its Triton kernel missing, and a fused op (not a norm: not plotted)."""
    rows = []
    for dtype in ("float32", "bfloat16"):
        for n in (1024, 8192):
            rows.append(_row("copy baseline", "fwd", n, dtype, 20.0, "baseline"))
            for kind, us in (("fwd", 25.0), ("fwd+bwd", 60.0)):
                rows.append(_row("rms_norm", kind, n, dtype, us))
                rows.append(_row("tokamax layer_norm [xla]", kind, n, dtype, 2 * us, "peer"))
                rows.append(_row("tokamax layer_norm [triton]", kind, n, dtype, None, "peer",
                                 "missing", "tokamax has no triton path here"))  # fmt: skip
                rows.append(_row("add_rms_norm", kind, n, dtype, us) | dict(group="add"))
    return dict(results=rows, quick=False)


def test_curves_are_the_least_bytes_over_the_median():
    panels, copy, absent = plot.curves(_section()["results"])
    assert set(panels) == {(MIB, k, d) for k in ("fwd", "fwd+bwd") for d in ("float32", "bfloat16")}
    fwd = panels[(MIB, "fwd", "float32")]
    assert set(fwd) == {"rms_norm", "tokamax layer_norm [xla]"}
    assert fwd["rms_norm"] == [(n, pytest.approx(2 * X_BYTES / 25e-6 / 1e9)) for n in (1024, 8192)]
    bwd = dict(panels[(MIB, "fwd+bwd", "bfloat16")]["rms_norm"])
    assert bwd[8192] == pytest.approx(5 * X_BYTES / 60e-6 / 1e9)
    assert copy[(MIB, "float32")] == pytest.approx(2 * X_BYTES / 20e-6 / 1e9)
    assert absent == {"tokamax layer_norm [triton]": "missing: tokamax has no triton path here"}


def test_report_draws_the_plot_from_a_results_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "h100-measured.json"
    rep = dict(device="NVIDIA H100 80GB HBM3", machine="1 x H100 (gpu)", sections={})
    rep["sections"]["ops"] = _section()
    path.write_text(json.dumps(rep))
    plot.main([str(path)])
    png = tmp_path / "h100-measured.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "drew" in capsys.readouterr().out


def test_the_plot_has_a_line_per_norm_and_the_copys_rate(tmp_path):
    pytest.importorskip("matplotlib")
    fig = plot.plot(_section(), tmp_path / "ops.png", "a title")
    axes = fig.axes
    assert len(axes) == 4  # fwd and fwd+bwd (rows) x float32 and bfloat16 (columns)
    assert [ax.get_title() for ax in axes[:2]] == [
        "fwd, float32, x of 32 MiB",
        "fwd, bfloat16, x of 32 MiB",
    ]
    legend = fig.legends[0]
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["rms_norm", "tokamax layer_norm [xla]", "copy baseline (median)"]
    assert "not measured: tokamax layer_norm [triton]" in legend.get_title().get_text()
    lines = {line.get_label(): line for line in axes[0].get_lines()}
    copy, ours = lines["copy baseline (median)"], lines["rms_norm"]
    assert list(copy.get_ydata()) == pytest.approx([2 * X_BYTES / 20e-6 / 1e9] * 2)  # level
    assert list(ours.get_xdata()) == [1024, 8192] and ours.get_linestyle() == "-"


def test_a_smoke_run_says_so_on_its_plot(tmp_path):
    pytest.importorskip("matplotlib")
    fig = plot.plot(_section() | dict(quick=True), tmp_path / "ops.png", "a title")
    assert report.SMOKE in fig._suptitle.get_text()


def test_without_matplotlib_the_report_names_the_command_that_draws_it(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    monkeypatch.chdir(tmp_path)
    rep = dict(device="d", sections=dict(ops=_section()))
    assert plot.draw(rep, tmp_path / "RESULTS" / "h100-measured.json") is None
    out = capsys.readouterr().out
    assert "python -m benchmarks.plot RESULTS/h100-measured.json" in out
    assert str(tmp_path) not in out


def test_a_report_is_replaced_whole(tmp_path):
    report.write(tmp_path, "cpu-measured", dict(sections={}), "# a report")
    report.write(tmp_path, "cpu-measured", dict(sections={"ops": {}}), "# again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu-measured.json", "cpu-measured.md"]
    assert json.loads((tmp_path / "cpu-measured.json").read_text()) == dict(sections={"ops": {}})


def test_the_kernel_note_names_the_backend():
    compiled = types.SimpleNamespace(as_text=lambda: 'custom_call_target="mosaic_gpu"')
    assert timing.kernel_backends(compiled) == ["Mosaic GPU"]
    assert ops.kernel_note(dict(uses_kernel=True, kernel_backends=["Mosaic GPU"])) == (
        "Pallas kernel: Mosaic GPU"
    )
    assert ops.kernel_note(dict(uses_kernel=True)) == "Pallas kernel"  # results before the names
    assert ops.kernel_note(dict(uses_kernel=False, kernel_backends=[])) == ""
