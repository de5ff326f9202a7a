"""bench.first_call's logic on the CPU (tiny configs): three fresh processes
per case, the row's fields and the issue's checks."""

import json

import pytest

pytest.importorskip("diffusers")


def test_tiny_first_call_rows(tmp_path):
    """One row per case from three fresh processes (unpatched, cold,
    warm), with the issue's checks; --off adds two more patched with
    PatchConfig(compile_ahead=False), on the warm cache and a cold one, and
    the cold one says whether its model was hooked to compile ahead. (One
    run with --off: it runs the three processes a plain run does, and the
    row's fields are the same.)"""
    from bench import first_call
    rows = first_call.main(["--tiny", "--off", "--only", "taef2", "--out", str(tmp_path)])
    (row,) = rows
    assert "error" not in row, row.get("error")
    for k in ("baseline_s", "cold_s", "warm_s", "first_call_s", "cold_over_s", "warm_over_s", "baseline_second_s",
              "cold_third_s"):
        assert isinstance(row[k], float) and row[k] >= 0 or k.endswith("over_s"), k
    assert row["baseline"] == first_call.BASELINE
    assert set(row["checks"]) == {"cold_within_5s", "warm_within_1s", "warm_compiles_nothing"}
    # (Nothing compiles under the interpreter: the counts are there, all 0.)
    assert row["cold_compiled"] == row["warm_compiled"] == [0, 0, 0] and row["checks"]["warm_compiles_nothing"]
    (doc,) = [json.loads(p.read_text()) for p in tmp_path.glob("first-call-*.json")]
    assert doc["rows"] == rows and "torch" in doc
    for k in ("off_s", "off_over_s", "warm_off_s", "warm_off_over_s"):
        assert isinstance(row[k], float), k
    assert row["compiled_ahead"] is True
    # Each patched process says what compiling ahead did at its first call,
    # or why it made none: on the CPU, no CUDA tensor.
    (line,) = row["cold_first_pass"]
    assert line.startswith("model: ") and line.endswith(": no compiling pass (no CUDA tensor in the call)"), line


def test_cached_kernels_counts_entries_holding_a_kernel(tmp_path):
    """A Triton cache entry with a kernel's metadata JSON counts; a
    launcher's (a library only) and a group file alone do not."""
    from bench.common import cached_kernels
    for name, files in (("a", ["k.json", "k.cubin", "__grp__k.json"]), ("b", ["__triton_launcher.so"]),
                        ("c", ["__grp__x.json"])):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("{}")
    assert cached_kernels(str(tmp_path)) == {"a"} and cached_kernels(str(tmp_path / "none")) == set()


def test_a_child_that_fails_leaves_an_error(tmp_path, monkeypatch):
    from bench import first_call
    monkeypatch.setattr(first_call, "child_rows", lambda *a, **k: (None, "child process exited with 1 and no row"))
    (row,) = first_call.main(["--tiny", "--only", "taef2", "--out", str(tmp_path)])
    assert row["error"].startswith("unpatched: child process exited") and "checks" not in row


def test_tiny_new_shapes_rows(tmp_path):
    """bench.new_shapes on the CPU: one row per shape, in order, each naming
    the shapes called before it; the unpatched first call as the baseline;
    nothing compiled under the interpreter."""
    from bench import new_shapes
    assert new_shapes.parse_shape("832x1216:2") == ((832, 1216), 2) and new_shapes.parse_shape("16") == (16, 1)
    rows = new_shapes.main(["--tiny", "--model", "flux-vae-decode", "--dtype", "fp32", "--shapes", "16", "16:2",
                            "12x20", "--out", str(tmp_path)])
    assert [r["shape"] for r in rows] == ["16x16 b1", "16x16 b2", "12x20 b1"]
    assert [r["after"] for r in rows] == [[], ["16x16 b1"], ["16x16 b1", "16x16 b2"]]
    for r in rows:
        assert r["baseline"] == new_shapes.BASELINE and r["compiles"] == 0 and r["compiled_kernels"] == {}
        assert r["ours_ms"] > 0 and r["baseline_ms"] > 0 and r["first_call_s"] == r["ours_ms"] / 1e3
    (doc,) = [json.loads(p.read_text()) for p in tmp_path.glob("new-shapes-flux-vae-decode-*.json")]
    assert doc["rows"] == rows and doc["cache"] == "as found"
