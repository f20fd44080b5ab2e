"""RESULTS.md rendering from small fake results files of each kind.

The gmm record has the layout ``benchmarks/gmm.py`` writes (nested
``tflops[impl][op]``, top-level gpu/jax/commit); the MoE layer one the layout
of ``benchmarks/moe_layer.py`` (``perf.measure`` provenance); the step one
the generic rows ``report.py`` documents.
"""

import json

import pytest

from dropless.perf import report

H200 = {"platform": "gpu", "gpu": "NVIDIA H200", "count": 1, "slug": "nvidia-h200"}
PROV = {"device": H200, "versions": {"jax": "0.11.2"}, "commit": {"commit": "a" * 40, "dirty": False}}


def gmm_record(ours_fwd=600.0):
    return {
        "benchmark": "gmm", "date": "2026-11-28T10:00:00", "gpu": "NVIDIA H200", "jax": "0.11.2",
        "commit": "b" * 40,
        "results": [{
            "M": 65536, "G": 32, "K": 7168, "N": 4096, "layout": "balanced",
            "tflops": {"ours": {"fwd": ours_fwd, "dgrad": 610.0},
                       "dense": {"fwd": 718.0, "dgrad": 720.0},
                       "torch": {"fwd": 712.0}, "ragged": {"fwd": 23.0}},
            "errors": {"ragged/dgrad": "OOM: RESOURCE_EXHAUSTED"},
        }],
    }


def moe_record(created, fwd_bwd_ms):
    rows = [{"case": "ours", "backend": "mosaic", "fwd_ms": 11.0, "fwd_bwd_ms": fwd_bwd_ms,
             "fwd_tflops": 590.0, "fwd_bwd_tflops": 19.48e12 / fwd_bwd_ms / 1e9,
             "dropped_fraction": 0.0},
            {"case": "xla", "backend": "xla", "fwd_ms": 300.0, "fwd_bwd_ms": None,
             "fwd_bwd_error": "XlaRuntimeError: RESOURCE_EXHAUSTED", "dropped_fraction": 0.0},
            {"case": "capacity-1.0", "error": "ValueError: boom"},
            {"case": "xla-big", "backend": "xla",
             "skipped": "fwd+bwd needs >= 112.8 GiB (ragged_dot's dense operands), device allows "
                        "105.3 GiB"}]
    pieces = [{"piece": p, "fwd_ms": 1.0, "fwd_bwd_ms": ms}
              for p, ms in (("router", 1.0), ("permute", 1.5), ("gmm", 25.0), ("combine", 1.0),
                            ("shared", 3.0))]
    return {"kind": "moe_layer", "created": created, **PROV,
            "config": {"tokens": 8192, "emb_dim": 7168, "moe_mlp_dim": 2048, "num_experts": 32,
                       "top_k": 8, "shared_experts": 1, "dtype": "bfloat16", "tiny": False},
            "rows": rows, "flops_formula": "fwd = 6*T*(K+S)*D*F",
            "targets": {"fwd_bwd_ms": 36.0, "routing_share_pct": 15.0,
                        "torchtitan_fwd_bwd_ms": 43.6, "torchtitan_gemm_ms": 31.7},
            "split": {"case": "ours", "backend": "mosaic", "pieces": pieces, "sum_fwd_ms": 5.0,
                      "sum_fwd_bwd_ms": 31.5, "layer_fwd_ms": 11.0, "layer_fwd_bwd_ms": fwd_bwd_ms,
                      "routing_share_fwd_bwd_pct": 100 * 3.5 / fwd_bwd_ms},
            "kernel_breakdown": {"categories": [
                {"category": "grouped_gemm", "label": "grouped GEMM", "pct_kernel": 80.0},
                {"category": "other", "label": "other", "pct_kernel": 20.0}]}}


def step_record():
    return {"kind": "step", "created": "2026-11-28T12:00:00+00:00", **PROV,
            "config": {"model_name": "deepseek3-proxy", "max_target_length": 4096},
            "rows": [{"name": "xla baseline", "role": "baseline", "tflops_per_device": 40.0,
                      "per_device_batch_size": 1, "note": "batch shrunk to fit"},
                     {"name": "dense_matmul baseline", "tflops_per_device": 50.0},
                     {"name": "ours", "tflops_per_device": 500.0, "tokens_per_s": 12345.0,
                      "step_ms": 800.0, "peak_memory_gib": 100.5}]}


@pytest.fixture
def results(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    (d / "gmm-2026-11-28-h200.json").write_text(json.dumps(gmm_record()))
    (d / "moe_layer-old.json").write_text(json.dumps(moe_record("2026-11-28T09:00:00+00:00", 50.0)))
    bundle = {"kind": "bench", "created": "2026-11-29T09:00:00+00:00", **PROV,
              "records": {"moe_layer": moe_record("2026-11-29T09:00:00+00:00", 34.0),
                          "step": {"error": "ImportError: no benchmarks/step.py"}}}
    (d / "20261129-090000-nvidia-h200.json").write_text(json.dumps(bundle))
    (d / "step-1.json").write_text(json.dumps(step_record()))
    no_commit = {**step_record(), "created": "2030-01-01T00:00:00+00:00", "commit": "unknown"}
    (d / "step-2.json").write_text(json.dumps(no_commit))
    cpu = {**moe_record("2031-01-01T00:00:00+00:00", 1.0), "device": {**H200, "gpu": "cpu"}}
    (d / "moe_layer-cpu.json").write_text(json.dumps(cpu))
    (d / "broken.json").write_text("{not json")
    return d


def test_newest_valid_record_of_each_kind(results):
    logged = []
    records = report.newest_records(results, log=logged.append)
    assert set(records) == {"gmm:deepseek", "moe_layer", "step:baselines"}
    assert records["moe_layer"][1].name == "20261129-090000-nvidia-h200.json"  # the bundle's is newer
    assert records["moe_layer"][0]["rows"][0]["fwd_bwd_ms"] == 34.0
    assert records["step:baselines"][1].name == "step-1.json"  # step-2 has no commit
    text = "\n".join(logged)
    assert "step-2.json (step): no commit" in text and "moe_layer-cpu.json" in text
    assert "broken.json" in text


def test_render_page(results, tmp_path):
    md = report.render(results, tmp_path / "out" / "RESULTS.md", log=lambda _: None)
    text = md.read_text()
    for title in ("## Grouped GEMM kernels", "## MoE layer", "## Training step"):
        assert title in text
    # gmm: values, ratios to the ceiling and to torch, recorded failures, provenance.
    assert "| M=65536 G=32 K=7168 N=4096 | balanced | fwd | 600.0 | 718.0 | 712.0 |" in text
    assert "0.84x | 0.84x |" in text
    assert "ragged/dgrad: OOM" in text and "`bbbbbbbbbbbb`" in text
    # MoE layer: the newest record, targets judged, split shares, error rows kept.
    assert "| ours | mosaic | 11.00 | 590 | 34.00 |" in text and "1.28x" in text
    assert "34.00 ms, met" in text and "10.3%, met" in text
    assert "XlaRuntimeError" in text and "error: ValueError: boom" in text
    assert "| xla-big | skipped: fwd+bwd needs >= 112.8 GiB" in text
    assert "| gmm | 1.000 | 25.000 | 73.5 |" in text
    # step: ratio to the best baseline.
    assert "| ours | ours | 500.0 | 10.00x |" in text and "| xla baseline | baseline | 40.0 | 0.80x |" in text
    assert "- MoE layer fwd+bwd: ours 34.0 ms (573 TF/s), 1.28x torchtitan's 43.6 ms" in text
    assert "- training step: ours 500 TFLOPS/device = 10.0x the best baseline" in text
    for fig in ("gmm_tflops.png", "moe_layer.png", "step_tflops.png"):
        assert (tmp_path / "out" / "figures" / fig).read_bytes()[:4] == b"\x89PNG"
        assert f"](figures/{fig})" in text


def test_missing_target_is_flagged(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / "m.json").write_text(json.dumps(moe_record("2026-11-29T00:00:00+00:00", 40.0)))
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    assert "40.00 ms, **not met**" in text and "## Grouped GEMM kernels\n_no results yet_" in text


def test_fp8_sections(tmp_path):
    """The FP8 kernel record (fp8_kernel_probe.py's layout) against its TF/s targets, and
    the quantization record's passes against the same-run copy and products against bf16."""
    d = tmp_path / "r"
    d.mkdir()
    kernels = {"kind": "fp8_kernels", "created": "2026-12-01T19:49:27+00:00", **PROV,
               "config": {"M": 65536, "G": 32, "K": 7168, "N": 4096, "layout": "balanced"},
               "rows": [{"variant": "rows_gtw8_o192", "product": "fwd", "kernel_ms": 3.0, "wall_ms": 3.2,
                         "tflops_kernel": 1300.0, "tflops_wall": 1200.0},
                        {"variant": "wgrad_rows_n160_sorted_chain", "product": "wgrad", "kernel_ms": 5.4,
                         "wall_ms": 5.7, "tflops_kernel": 711.0, "tflops_wall": 674.0},
                        {"variant": "wgrad_rows", "product": "wgrad",
                         "bitwise_equal_to": "wgrad_rows_n160_sorted_chain", "equal": True}]}
    quant = {"kind": "fp8_quant", "created": "2026-12-01T19:50:00+00:00", **PROV,
             "rows": [{"section": "pass", "name": "copy", "kernel_ms": 0.5, "wall_ms": 0.6,
                       "gbps_kernel": 3000.0},
                      {"section": "pass", "name": "rows", "kernel_ms": 1.0, "wall_ms": 1.1,
                       "gbps_kernel": 1500.0},
                      {"section": "product", "name": "fwd+bwd kernel path", "kernel_ms": 20.0,
                       "wall_ms": 21.0, "tflops_kernel": 600.0},
                      {"section": "product", "name": "fwd+bwd FP8 kernels alone",
                       "kernel_ms": 10.0, "wall_ms": 11.0, "tflops_kernel": 1200.0},
                      {"section": "product", "name": "fwd+bwd bf16 kernel", "kernel_ms": 16.0,
                       "wall_ms": 17.0, "tflops_kernel": 750.0}]}
    (d / "k.json").write_text(json.dumps(kernels))
    (d / "q.json").write_text(json.dumps(quant))
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    assert "| rows_gtw8_o192 | fwd | 3.000 | 3.200 | 1300 | 1200 | 1250: met |" in text
    assert "| wgrad_rows_n160_sorted_chain | wgrad | 5.400 | 5.700 | 711 | 674 | 1100: **not met** |" in text
    assert "wgrad wgrad_rows == wgrad_rows_n160_sorted_chain: True" in text
    assert "| rows | 1.000 | 1.100 | 1,500 | 0.50x |" in text
    assert "| fwd+bwd kernel path | 20.000 | 21.000 | 600 | 0.80x |" in text
    assert ("- FP8 fwd+dgrad+wgrad with quantization 20.0 ms = 0.80x bf16's 16.0 ms "
            "(kernels alone 10.0 ms = 1.60x)") in text
    assert ("- FP8 kernels alone (CUPTI, default variants): fwd rows_gtw8_o192 1300 TF/s (target 1250), "
            "wgrad wgrad_rows_n160_sorted_chain 711 TF/s (target 1100)") in text
    # With the Pallas quantizers' row, the headline leads with it (the default path).
    quant["rows"].append({"section": "product", "name": "fwd+bwd kernel path, pallas q",
                          "kernel_ms": 12.8, "wall_ms": 13.5, "tflops_kernel": 900.0})
    assert report.headlines("fp8_quant", quant) == [
        "FP8 fwd+dgrad+wgrad with quantization (Pallas quantizers) 12.8 ms = 1.25x bf16's 16.0 ms "
        "(XLA's quantization 20.0 ms = 0.80x; kernels alone 10.0 ms = 1.60x)"]
    # With the default quantizers' row (auto), the headline leads with it, Pallas's beside.
    quant["rows"].append({"section": "product", "name": "fwd+bwd kernel path, auto q",
                          "kernel_ms": 12.5, "wall_ms": 13.0, "tflops_kernel": 920.0})
    assert report.headlines("fp8_quant", quant) == [
        "FP8 fwd+dgrad+wgrad with quantization (default quantizers) 12.5 ms = 1.28x bf16's 16.0 ms "
        "(Pallas quantizers 12.8 ms = 1.25x; XLA's quantization 20.0 ms = 0.80x; "
        "kernels alone 10.0 ms = 1.60x)"]


def fp8_kernels_record(created, rows):
    """An ``fp8_kernel_probe.py`` record of timed rows (variant, product, TF/s by CUPTI)."""
    return {"kind": "fp8_kernels", "created": created, **PROV,
            "config": {"M": 65536, "G": 32, "K": 7168, "N": 4096, "layout": "balanced"},
            "rows": [{"variant": v, "product": p, "kernel_ms": 1.0, "wall_ms": 1.1,
                      "tflops_kernel": tf, "tflops_wall": tf - 50} for v, p, tf in rows]}


def test_fp8_kernels_wgrad_sweep_keeps_the_products_record(tmp_path):
    """A newer wgrad-only sweep (``--variants=``) does not replace the record of all three
    products: both render, the sweep in its own subsection; the products' headline quotes
    the default variants even where another is faster (and says so where the record, older
    than the default, lacks it), and the sweep's names its default, bf16 and best."""
    d = tmp_path / "r"
    d.mkdir()
    products = fp8_kernels_record("2026-12-01T19:49:27+00:00", [
        ("rows_gtw8_o192", "fwd", 1136.0), ("rows_gtw8_o192", "dgrad", 1104.0),
        ("cols_gtw1", "fwd", 1200.0), ("cols_gtw1", "dgrad", 796.0),
        ("wgrad_columns", "wgrad", 711.0), ("wgrad_rows", "wgrad", 702.0)])
    sweep = fp8_kernels_record("2026-12-02T10:45:20+00:00", [
        ("wgrad_columns", "wgrad", 712.0), ("wgrad_columns_bf16", "wgrad", 753.0),
        ("wgrad_rows_n160_sorted_chain", "wgrad", 732.0), ("wgrad_rows_n160_sorted_chain_bf16", "wgrad", 791.0),
        ("wgrad_rows_bf16", "wgrad", 745.0)])
    sweep["rows"].append({"variant": "wgrad_rows_n160_sorted_chain", "product": "wgrad",
                          "bitwise_equal_to": "wgrad_columns", "equal": True})
    (d / "fp8_kernels-products.json").write_text(json.dumps(products))
    (d / "fp8_kernels-sweep.json").write_text(json.dumps(sweep))
    newest = report.newest_records(d, log=lambda _: None)
    assert {k: p.name for k, (_, p) in newest.items()} == {
        "fp8_kernels:products": "fp8_kernels-products.json",
        "fp8_kernels:wgrad sweep": "fp8_kernels-sweep.json"}
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    assert ("- FP8 kernels alone (CUPTI, default variants): fwd rows_gtw8_o192 1136 TF/s (target 1250), "
            "dgrad rows_gtw8_o192 1104 TF/s (target 1250), wgrad wgrad_columns 711 TF/s (target 1100; "
            "the best timed, the default wgrad_rows_n160_sorted_chain was not)") in text
    assert ("- FP8 wgrad variant sweep (CUPTI): default wgrad_rows_n160_sorted_chain 732 TF/s, bf16 output, "
            "as trained wgrad_rows_n160_sorted_chain_bf16 791 TF/s (target 1100)") in text
    section = text[text.index("## FP8 grouped GEMM kernels"):]
    sweep_at = section.index("### wgrad variant sweep")
    assert "| cols_gtw1 | fwd | 1.000 | 1.100 | 1200 | 1150 | 1250: **not met** |" in section[:sweep_at]
    assert "`fp8_kernels-products.json`" in section[:sweep_at]
    assert "| wgrad_rows_n160_sorted_chain_bf16 | wgrad | 1.000 | 1.100 | 791 | 741 |" in section[sweep_at:]
    assert "wgrad wgrad_rows_n160_sorted_chain == wgrad_columns: True" in section[sweep_at:]
    assert "`fp8_kernels-sweep.json`" in section[sweep_at:]
    # dropless bench passes the bare kind: the variant comes from the record.
    assert report.headlines("fp8_kernels", sweep)[0].startswith("FP8 wgrad variant sweep")


def test_fp8_kernels_headline_without_the_default_variant():
    """A products record that did not time a product's default variant quotes its best, and
    says so."""
    record = fp8_kernels_record("2026-12-01T00:00:00+00:00", [
        ("cols_gtw1", "fwd", 850.0), ("rows_gtw4", "fwd", 1000.0)])
    assert report.headlines("fp8_kernels", record) == [
        "FP8 kernels alone (CUPTI, default variants): fwd rows_gtw4 1000 TF/s (target 1250; the "
        "best timed, the default rows_gtw8_o192 was not)"]


def test_commit_prefers_dropless_commit(monkeypatch):
    """A copy of the tree on a GPU machine may carry a stale .git: the commit the caller
    names wins."""
    from dropless.perf import measure

    monkeypatch.setenv("DROPLESS_COMMIT", "c0ffee1")
    assert measure.git_commit() == {"commit": "c0ffee1", "dirty": None, "source": "env"}
    monkeypatch.delenv("DROPLESS_COMMIT")
    assert measure.git_commit()["source"] in ("git", "unknown")


def profile_record(precision, created, grouped_ms, quant_ms, step_ms=500.0, **cfg):
    """A ``dropless profile`` record; kernel time = grouped + 100 dense + 80 attention +
    quantization + 20 other ms per step."""
    ms = {"grouped_gemm": grouped_ms, "dense_gemm": 100.0, "attention": 80.0,
          "quantization": quant_ms, "communication": 0.0, "host_device_copy": 0.0, "other": 20.0}
    total = sum(ms.values())
    rows = [{"category": c, "label": c.replace("_", " "), "ms_per_step": v,
             "pct_kernel": 100 * v / total, "pct_wall": 100 * v / step_ms, "count": 3}
            for c, v in ms.items()]
    config = {"model_name": "deepseek3-proxy", "quantization": "", "remat_policy": "full",
              "te_gmm_quantization": "te_no_quant", "gmm_fp8_impl": "emulate", **cfg}
    if precision is not None:
        config["precision"] = precision
    return {"kind": "profile", "created": created, **PROV, "config": config, "rows": rows,
            "step_ms": step_ms, "kernel_ms_per_step": total, "tflops_per_device": 400.0}


def test_profile_bf16_and_fp8_side_by_side(tmp_path):
    """The newest record of each precision renders; an older bf16 one is not used; a record
    without 'precision' is placed by its quantization keys."""
    d = tmp_path / "r"
    d.mkdir()
    (d / "p-old.json").write_text(json.dumps(profile_record("bf16", "2026-12-01T00:00:00+00:00",
                                                            999.0, 0.0)))
    (d / "p-bf16.json").write_text(json.dumps(profile_record("bf16", "2026-12-02T00:00:00+00:00",
                                                             200.0, 0.0)))
    fp8 = profile_record(None, "2026-12-02T01:00:00+00:00", 150.0, 50.0, step_ms=450.0,
                         quantization="te_fp8_currentscaling",
                         te_gmm_quantization="te_fp8_blockwise", gmm_fp8_impl="auto",
                         gmm_fp8_impl_resolved={"wi": "kernel", "wo": "kernel"})
    (d / "p-fp8.json").write_text(json.dumps(fp8))
    records = report.newest_records(d, log=lambda _: None)
    assert set(records) == {"profile:bf16", "profile:fp8"}
    assert records["profile:bf16"][1].name == "p-bf16.json"
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    assert "## Step profile" in text and "_no profile yet_" not in text
    assert "| category | bf16 ms/step | bf16 % kernel | bf16 % wall | fp8 ms/step |" in text
    # grouped 200 of 400 ms kernel time, 40% of the 500 ms step; FP8: 150 of 400, 33.3% of 450.
    assert "| grouped gemm | 200.00 | 50.0 | 40.0 | 150.00 | 37.5 | 33.3 |" in text
    assert "| quantization | 0.00 | 0.0 | 0.0 | 50.00 | 12.5 | 11.1 |" in text
    assert "| **step (wall)** | 500.00 | - | - | 450.00 | - | - |" in text
    assert "`te_gmm_quantization=te_fp8_blockwise`" in text and "`p-fp8.json`" in text
    assert "`gmm_fp8_impl=auto (ran: kernel)`" in text  # what auto ran as, one word: both agree
    assert ("- step profile (fp8): 450 ms/step, 400 TFLOPS/device; kernel time: grouped gemm 38%, "
            "dense gemm 25%, attention 20%, quantization 12%, other 5%") in text
    assert "- step profile (bf16): 500 ms/step" in text
    assert (tmp_path / "figures" / "profile_categories.png").read_bytes()[:4] == b"\x89PNG"
    assert "](figures/profile_categories.png)" in text
    assert "_Not one run_" not in text  # one commit: nothing to warn of


def test_profiles_of_two_commits_say_they_are_not_one_run(tmp_path):
    """bf16 and FP8 profiles from different commits (so different runs, likely different
    loans) render with a line saying their step times are no same-run ratio."""
    d = tmp_path / "r"
    d.mkdir()
    (d / "p-bf16.json").write_text(json.dumps(profile_record("bf16", "2026-12-02T00:00:00+00:00",
                                                             200.0, 0.0)))
    fp8 = {**profile_record("fp8", "2026-12-02T01:00:00+00:00", 150.0, 50.0),
           "commit": {"commit": "abcdef0123", "dirty": None, "source": "env"}}
    (d / "p-fp8.json").write_text(json.dumps(fp8))
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    assert ("- _Not one run_ (bf16 at `aaaaaaa`, fp8 at `abcdef0`): the step times are not "
            "a same-run ratio") in text


def test_profile_bf16_only(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / "p.json").write_text(json.dumps(profile_record("bf16", "2026-12-02T00:00:00+00:00",
                                                        200.0, 0.0)))
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    assert "- fp8: _no profile yet_" in text
    assert "| category | bf16 ms/step | bf16 % kernel | bf16 % wall |\n" in text
    assert "fp8 ms/step" not in text and "- step profile (bf16): 500 ms/step" in text
    assert (tmp_path / "figures" / "profile_categories.png").exists()


def test_fp8_dense_section(tmp_path):
    """fp8_dense.py's record: per-matmul bf16 and FP8 times, speed-up, share, FP8 dot count."""
    d = tmp_path / "r"
    d.mkdir()
    row = {"name": "mla.wq_a", "K": 7168, "N": 1536, "count": 4, "fp8_in_model": True,
           "bf16": {"fwd_bwd_ms": 2.0, "dots": 3, "f8_dots": 0},
           "fp8": {"fwd_bwd_ms": 1.6, "dots": 3, "f8_dots": 3, "hlo_check": 2},
           "share_bf16_pct": 12.5}
    head = {**row, "name": "head.head", "K": 7168, "N": 129280, "count": 1, "fp8_in_model": False}
    rec = {"kind": "fp8_dense", "created": "2026-12-02T10:00:00+00:00", **PROV, "rows": [row, head],
           "totals": {"step_ms_bf16": 10.0, "step_ms_fp8_as_configured": 8.0, "step_ms_fp8_all": 7.5,
                      "time_source": "cupti"}}
    (d / "f.json").write_text(json.dumps(rec))
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    assert "| mla.wq_a | 7168 x 1536 | 4 | 2.000 | 1.600 | 1.25x | 12.5 | 3/3 |" in text
    assert "| head.head | 7168 x 129280 | 1 | 2.000 | 1.600 | 1.25x | 12.5 | 3/3 (bf16 in the model) |" in text
    assert "FP8 as configured 8.00 ms (1.25x), every matmul in FP8 7.50 ms (1.33x); times by cupti." in text
    assert "n/c" not in text


def test_fp8_dense_section_old_hlo_parser(tmp_path):
    """Rows checked by the parser before hlo_check 2 (no operand types seen on the GPU, so its
    0/3 was wrong) show n/c, with the f8 types and the error against bf16 as the evidence."""
    d = tmp_path / "r"
    d.mkdir()
    fp8 = {"fwd_bwd_ms": 1.6, "dots": 3, "f8_dots": 0, "f8e4m3": True, "f8e5m2": True}
    rows = [{"name": name, "K": 7168, "N": 1536, "count": 4, "fp8_in_model": True,
             "bf16": {"fwd_bwd_ms": 2.0, "dots": 3, "f8_dots": 0},
             "fp8": {**fp8, "rel_err_y": err}, "share_bf16_pct": 50.0}
            for name, err in (("mla.wq_a", 0.0371), ("mla.wo", 0.0384))]
    rec = {"kind": "fp8_dense", "created": "2026-12-02T10:00:00+00:00", **PROV, "rows": rows}
    (d / "f.json").write_text(json.dumps(rec))
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    assert "| mla.wq_a | 7168 x 1536 | 4 | 2.000 | 1.600 | 1.25x | 50.0 | n/c |" in text
    assert "0/3" not in text
    assert "n/c: FP8 dots not checked." in text
    assert "E4M3 and E5M2 in every row's HLO, and the FP8 output's relative error against " \
           "bf16, 3.7e-02 to 3.8e-02." in text


def step_py_record(time, cases, **case_overrides):
    """A ``benchmarks/step.py`` record: "time" (no "created"), top-level provenance, "cases"
    of (name, TFLOPS or an error text, extra fields) and "case_overrides"."""
    rows = []
    for name, result, extra in cases:
        row = ({"error": result} if isinstance(result, str) else
               {"tflops_per_device": result, "step_time_s": 0.4, "tokens_per_s": 1000.0 * result,
                "peak_memory_gb": 60.0 + result / 100, "per_device_batch_size": 2.0})
        rows.append({"case": name, **row, **extra})
    return {"benchmark": "step", "time": time, "gpu": "NVIDIA H200", "jax": "0.11.2",
            "commit": "c" * 40, "cases": rows,
            "case_overrides": {n: ["gmm_backend=auto", *o] for n, o in case_overrides.items()}}


FP8KP = ["te_gmm_quantization=te_fp8_blockwise", "gmm_fp8_impl=kernel"]
TRACEBACK = "exit 1: Traceback (most recent call last):\n  File | x.py, line 1\n" + "y" * 200


def test_step_variant():
    """Only cases with a TFLOPS result decide what a record compares."""
    baselines = step_py_record("t", [("ours", 400.0, {}), ("xla", 50.0, {}),
                                     ("capacity", 250.0, {})])
    xla_alone = step_py_record("t", [("ours", 400.0, {}), ("xla", 50.0, {})])
    failed_xla = step_py_record("t", [("ours", 400.0, {}), ("xla", "OOM", {})])
    fp8 = step_py_record("t", [("ours", 400.0, {}), ("ours_fp8kp", 420.0, {})])
    failed_fp8 = step_py_record("t", [("ours", 400.0, {}), ("ours_fp8kp", "boom", {})])
    qwen3 = step_py_record("t", [("qwen3-moe-proxy", 300.0, {})])
    assert [report.step_variant(r) for r in (baselines, xla_alone, failed_xla, fp8, failed_fp8,
                                              qwen3)] == [
        "baselines", "baselines xla", "models", "fp8", "models", "models"]
    assert report.step_variant(step_record()) == "baselines"  # role "baseline" given by the row


def test_step_variants_render(tmp_path):
    """A newer qwen3-only record does not replace the baseline table: each kind of step
    record renders, FP8 cases against the same run's ours, single runs newest per case."""
    d = tmp_path / "r"
    d.mkdir()
    deepseek = {"overrides": ["model_name=deepseek3-proxy", "gmm_backend=auto"]}
    records = {
        "step-a.json": step_py_record("2026-11-29T10:33:59", [
            ("ours", 400.0, {}), ("capacity", 250.0, {}), ("xla", 50.0, {})]),
        "step-b.json": step_py_record("2026-12-01T22:08:13", [
            ("ours", 380.0, {}), ("ours_gfp8kp", TRACEBACK, {}),
            ("ours_fp8_blockwise", 342.0, {"gmm_fp8_impl_resolved": {"wi": "kernel",
                                                                     "wo": "emulate"}})],
            ours=[], ours_gfp8kp=FP8KP, ours_fp8_blockwise=FP8KP[:1]),
        "step-c.json": step_py_record("2026-12-01T22:14:12", [
            ("ours", 400.0, {}),
            ("ours_fp8kp", 420.0, {"gmm_fp8_impl_resolved": {"wi": "kernel", "wo": "kernel"}})],
            ours=[], ours_fp8kp=FP8KP),
        "step-d.json": step_py_record("2026-11-29T10:31:40", [("ours", 390.0, deepseek)]),
        "step-e.json": step_py_record("2026-12-01T22:22:27", [("ours", 401.0, deepseek)]),
        "step-f.json": step_py_record("2026-12-01T22:23:47", [
            ("qwen3-moe-proxy", 318.0, {"config": {"model_name": "qwen3-moe-proxy"}})]),
        # A newer run of the xla baseline alone (at batch 1) keeps a's table.
        "step-g.json": step_py_record("2026-12-02T08:00:00", [
            ("xla", 40.0, {"per_device_batch_size": 1.0}),
            ("ours", 300.0, {"per_device_batch_size": 1.0})]),
    }
    for name, record in records.items():
        (d / name).write_text(json.dumps(record))
    newest = report.newest_records(d, log=lambda _: None)
    assert {k: p.name for k, (_, p) in newest.items()} == {
        "step:baselines": "step-a.json", "step:baselines xla": "step-g.json",
        "step:fp8": "step-c.json", "step:models": "step-f.json"}
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    section = text[text.index("## Training step"):]
    # The baseline table, unchanged: ratios to the best baseline (capacity, 250).
    assert "| ours | ours | 400.0 | 1.60x | 400,000 | 400.0 | 64.0 | 2 | - |" in section
    assert "| capacity | baseline | 250.0 | 1.00x |" in section and "qwen3-moe-proxy | baseline" \
        not in section
    assert "](figures/step_tflops.png)" in section
    # g's own table, after a's, its ratio to its own xla row.
    assert section.index("### Ours against the baselines (capacity, xla)") < section.index(
        "### Ours against the baselines (xla)")
    assert "| ours | ours | 300.0 | 7.50x |" in section
    assert "](figures/step_tflops_xla.png)" in section
    # FP8: the newest fp8 record (c), against its own ours (400, not b's 380 or a's).
    assert ("| ours_fp8kp | kernel | `te_gmm_quantization=te_fp8_blockwise` "
            "`gmm_fp8_impl=kernel` | 420.0 | 1.05x | 420,000 | 400.0 | 64.2 | 2 | - |") in section
    assert "| ours | - | - | 400.0 | 1.00x |" in section
    # Single runs: the newest ours (e, not d) and qwen3 (f), each with its file, no ratios.
    assert ("| ours | deepseek3-proxy | `step-e.json` | 401.0 | 401,000 | 400.0 | 64.0 | 2 | - |"
            in section)
    assert "| qwen3-moe-proxy | qwen3-moe-proxy | `step-f.json` | 318.0 |" in section
    assert "step-d.json" not in text and "ratios are only given within one run" in section
    order = [section.index(h) for h in ("### Ours against the baselines",
                                        "### FP8 and other variants of ours",
                                        "### Other models and single runs")]
    assert order == sorted(order)
    # Headlines, and the sources table's time from step.py's "time" field.
    assert ("- training step: ours 400 TFLOPS/device = 1.6x the best baseline (capacity, "
            "batch 2, same run of 2026-11-29)") in text
    assert "- training step: ours 300 TFLOPS/device = 7.5x the best baseline (xla, batch 1" in text
    assert "- training step, variant ours_fp8kp 420 TFLOPS/device = 1.05x ours (same run)" in text
    assert "qwen3-moe-proxy 318 TFLOPS" not in text
    assert "| step:models | `step-f.json` | NVIDIA H200 | 0.11.2 | `cccccccccccc` | " \
           "2026-12-01T22:23:47 |" in text
    assert "2026-12-01T22:14:12)." in section and ", ?)" not in text


def test_step_fp8_errors_and_resolved_impl(tmp_path):
    """An FP8 record with a failed case: the error's first 80 characters on one line, pipes
    escaped; a per-matmul resolved impl; the headline skips the failed case."""
    d = tmp_path / "r"
    d.mkdir()
    record = step_py_record("2026-12-01T22:08:13", [
        ("ours", 400.0, {}), ("ours_gfp8kp", TRACEBACK, {}),
        ("ours_fp8_blockwise", 342.0,
         {"gmm_fp8_impl_resolved": {"wi": "kernel", "wo": "emulate"}})],
        ours=[], ours_gfp8kp=FP8KP, ours_fp8_blockwise=FP8KP[:1])
    (d / "step-b.json").write_text(json.dumps(record))
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    note = " ".join(TRACEBACK.split())[:80].replace("|", "\\|")
    assert note.startswith("exit 1: Traceback (most recent call last): File \\| x.py")
    assert (f"| ours_gfp8kp | - | `te_gmm_quantization=te_fp8_blockwise` `gmm_fp8_impl=kernel` "
            f"| - | - | - | - | - | - | {note} |") in text
    assert "| ours_fp8_blockwise | wi=kernel, wo=emulate | `te_gmm_quantization=te_fp8_blockwise` " \
           "| 342.0 | 0.85x |" in text
    assert report.headlines("step", record) == [
        "training step, variant ours_fp8_blockwise 342 TFLOPS/device = 0.85x ours (same run)"]
    assert "### Ours against the baselines" not in text


def test_fp8_loss_records_reach_the_headlines(tmp_path):
    """``fp8_loss`` is a known kind: its newest record gives a headline (it has no section)."""
    rec = {"kind": "fp8_loss", "created": "2026-12-01T22:00:00+00:00", **PROV,
           "config": {"steps": 300, "judged": True},
           "rows": [{"case": "bf16", "rel_diff": 0.0, "passed": True},
                    {"case": "fp8_blockwise", "rel_diff": -0.0002, "passed": True}]}
    (tmp_path / "fp8_loss-1.json").write_text(json.dumps(rec))
    text = report.render(tmp_path, tmp_path / "R.md", log=lambda _: None).read_text()
    assert "- final LM loss vs bf16 after 300 steps: fp8_blockwise -0.02%" in text


def test_step_rows_name_the_runs_extra_overrides_and_a_partial_run():
    """A run given ``--set`` overrides, or cut short, is not the plain case: its rows say so
    (and a row's own note or error wins)."""
    from dropless.perf.report_step import step_rows

    record = {"extra_overrides": ["scan_layers=false"], "partial": True,
              "cases": [{"case": "ours", "tflops_per_device": 491.0},
                        {"case": "ours_fp8_blockwise", "error": "timed out"}]}
    notes = [r["note"] for r in step_rows(record)]
    assert notes == ["`scan_layers=false` (partial run)", "timed out"]
    assert [r["note"] for r in step_rows({"cases": [{"case": "ours", "tflops_per_device": 1}]})] == [""]


def test_step_rows_note_the_timed_steps_gpu_clock_and_power():
    """``step.py``'s ``gpu_clocks`` (``perf.clocks``) shows in the row's note; an unsampled
    run (no NVML) adds nothing."""
    from dropless.perf.report_step import step_rows

    sampled = {"available": True, "sm_mhz_median": 1530.0, "power_w_median": 688.4}
    record = {"cases": [
        {"case": "ours", "tflops_per_device": 490.5, "gpu_clocks": sampled},
        {"case": "ours_fp8_blockwise", "tflops_per_device": 539.6, "note": "MFU of the fp8 peak",
         "gpu_clocks": {**sampled, "power_w_median": None}},
        {"case": "xla", "tflops_per_device": 51.0,
         "gpu_clocks": {"available": False, "reason": "pynvml not importable"}}]}
    assert [r["note"] for r in step_rows(record)] == [
        "SM 1,530 MHz, 688 W", "MFU of the fp8 peak; SM 1,530 MHz", ""]


def test_step_fp8_with_set_overrides_is_its_own_variant(tmp_path):
    """A run whose every case took ``--set`` overrides (a smaller vocabulary, say) does not
    replace the plain FP8 comparison: both render, the overrides named in the title."""
    d = tmp_path / "r"
    d.mkdir()
    plain = step_py_record("2026-12-02T05:09:29", [("ours", 484.5, {}), ("ours_fp8_blockwise",
                                                                         503.8, {})])
    small = step_py_record("2026-12-02T07:31:54", [("ours", 465.4, {}), ("ours_fp8_blockwise",
                                                                         489.3, {})])
    small["extra_overrides"] = ["vocab_size=16384"]
    (d / "step-plain.json").write_text(json.dumps(plain))
    (d / "step-small.json").write_text(json.dumps(small))
    newest = report.newest_records(d, log=lambda _: None)
    assert {k: p.name for k, (_, p) in newest.items()} == {
        "step:fp8": "step-plain.json", "step:fp8 vocab_size=16384": "step-small.json"}
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    assert "### FP8 and other variants of ours\n" in text
    assert "### FP8 and other variants of ours, every case with `vocab_size=16384`" in text
    assert "- training step, variant ours_fp8_blockwise 504 TFLOPS/device = 1.04x ours" in text
    assert ("- training step (vocab_size=16384), variant ours_fp8_blockwise 489 TFLOPS/device "
            "= 1.05x ours (same run)") in text


def test_step_unquantized_variants_of_ours_are_their_own_variant(tmp_path):
    """A run comparing ``ours_scan`` (no quantization key) with ours is not hidden by a
    later FP8 run: each renders in its own subsection with its own headline."""
    d = tmp_path / "r"
    d.mkdir()
    scan = step_py_record("2026-12-02T10:37:15", [("ours", 485.0, {}), ("ours_scan", 478.9, {})],
                          ours=[], ours_scan=["scan_layers=true"])
    fp8 = step_py_record("2026-12-02T10:49:14", [("ours", 485.2, {}),
                                                 ("ours_fp8_blockwise", 501.0, {})],
                         ours=[], ours_fp8_blockwise=FP8KP[:1])
    (d / "step-scan.json").write_text(json.dumps(scan))
    (d / "step-fp8.json").write_text(json.dumps(fp8))
    newest = report.newest_records(d, log=lambda _: None)
    assert {k: p.name for k, (_, p) in newest.items()} == {
        "step:variants": "step-scan.json", "step:fp8": "step-fp8.json"}
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    fp8_at = text.index("### FP8 and other variants of ours\n")
    other_at = text.index("### Other variants of ours (same run)\n")
    assert fp8_at < other_at
    assert "| ours_fp8_blockwise | - | `te_gmm_quantization=te_fp8_blockwise` | 501.0 | 1.03x |" \
        in text[fp8_at:other_at]
    assert "| ours_scan | - | `scan_layers=true` | 478.9 | 0.99x |" in text[other_at:]
    assert "`step-scan.json`" in text[other_at:]
    assert "- training step, variant ours_scan 479 TFLOPS/device = 0.99x ours (same run)" in text
    assert "- training step, variant ours_fp8_blockwise 501 TFLOPS/device = 1.03x ours" in text


def test_step_variant_reads_the_quantization_keys():
    """Only ``ours_*`` cases whose overrides are known and set no quantization recipe make a
    record "variants"; a failed FP8 case still counts, and a recipe of "no quantization"
    does not."""
    def record(**case_overrides):
        cases = [("ours", 400.0, {}), ("ours_scan", 390.0, {}),
                 *[(n, "boom", {}) for n in case_overrides if n not in ("ours", "ours_scan")]]
        return step_py_record("t", cases, **case_overrides)

    assert report.step_variant(record(ours=[], ours_scan=["scan_layers=true"])) == "variants"
    assert report.step_variant(record(ours=[], ours_scan=["te_gmm_quantization=te_no_quant",
                                                          "quantization="])) == "variants"
    assert report.step_variant(record(ours=[], ours_scan=["gmm_quantization=te_mxfp8"])) == "fp8"
    assert report.step_variant(record(ours=[], ours_scan=[], ours_fp8=FP8KP)) == "fp8"
    assert report.step_variant(record(ours=[])) == "fp8"  # ours_scan's overrides unknown
    with_set = record(ours=[], ours_scan=["scan_layers=true"])
    with_set["extra_overrides"] = ["vocab_size=16384"]
    assert report.step_variant(with_set) == "variants vocab_size=16384"


def _render_gmm_records(tmp_path, first, second):
    """Records gmm-a.json (``first``) and gmm-b.json (``second``): the newest record file
    per key, and the rendered RESULTS.md."""
    d = tmp_path / "r"
    d.mkdir()
    (d / "gmm-a.json").write_text(json.dumps(first))
    (d / "gmm-b.json").write_text(json.dumps(second))
    newest = report.newest_records(d, log=lambda _: None)
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    return {k: p.name for k, (_, p) in newest.items()}, text


def _render_beside_a_deepseek_run(tmp_path, other):
    """gmm-a.json the whole DeepSeek-V3 set, gmm-b.json ``other`` (``_render_gmm_records``)."""
    return _render_gmm_records(tmp_path, gmm_record(), other)


def test_gmm_shape_sets_render_side_by_side(tmp_path):
    """A newer record of another shape set (``--shape-set qwen3-30b``) does not hide the
    DeepSeek-V3 shapes: each set renders its newest record, DeepSeek's first."""
    qwen = gmm_record(ours_fwd=574.0)
    qwen.update(date="2026-12-02T07:52:00", shape_set="qwen3-30b")
    qwen["results"][0].update(G=128, K=768, N=2048)
    newest, text = _render_beside_a_deepseek_run(tmp_path, qwen)
    assert newest == {"gmm:deepseek": "gmm-a.json", "gmm:qwen3-30b": "gmm-b.json"}
    first, second = text.index("### Shapes: deepseek"), text.index("### Shapes: qwen3-30b")
    assert first < second
    assert "| 600.0 |" in text[first:second] and "| 574.0 |" in text[second:]
    assert (tmp_path / "figures" / "gmm_tflops.png").exists()
    assert (tmp_path / "figures" / "gmm_tflops_qwen3-30b.png").exists()


def test_gmm_run_of_some_shapes_keeps_the_whole_set(tmp_path):
    """A newer run of one shape of the set (``gmm.py --shapes 2``, G=256) renders as its
    own table and leaves the set's newest whole run in place."""
    g256 = gmm_record(ours_fwd=656.0)
    g256.update(date="2026-12-03T10:43:01", shape_set="deepseek", shape_selection="2")
    g256["results"][0].update(G=256)
    newest, text = _render_beside_a_deepseek_run(tmp_path, g256)
    assert newest == {"gmm:deepseek": "gmm-a.json", "gmm:deepseek-shapes2": "gmm-b.json"}
    whole, part = text.index("### Shapes: deepseek\n"), text.index("### Shapes: deepseek-shapes2")
    assert whole < part
    assert "| 600.0 |" in text[whole:part] and "| 656.0 |" in text[part:]


def test_gmm_runs_of_other_custom_shapes_each_keep_their_table(tmp_path):
    """``gmm.py --shape`` runs (shape set "custom") at two different shapes both render:
    a newer custom run at G=32 does not hide the older one at G=256."""
    old = gmm_record(ours_fwd=718.0)
    old.update(date="2026-12-03T17:26:14", shape_set="custom")
    old["results"][0].update(G=256, K=7168, N=4096)
    new = gmm_record(ours_fwd=806.0)
    new.update(date="2026-12-03T22:01:46", shape_set="custom")
    new["results"][0].update(G=32, K=7168, N=4096)
    newest, text = _render_gmm_records(tmp_path, old, new)
    assert newest == {"gmm:custom-G256-K7168-N4096": "gmm-a.json",
                      "gmm:custom-G32-K7168-N4096": "gmm-b.json"}
    assert "| 718.0 |" in text and "| 806.0 |" in text


def test_fp8_kernels_sweeps_at_other_shapes_are_their_own_variant(tmp_path):
    """A wgrad sweep at another shape or layout (a Qwen3 skewed one) does not replace the
    DeepSeek balanced sweep: each renders under its own title; the other shape's rows and
    headline carry no DeepSeek target."""
    d = tmp_path / "r"
    d.mkdir()
    deepseek = fp8_kernels_record("2026-12-02T10:45:20+00:00", [
        ("wgrad_rows_n160_sorted_chain", "wgrad", 732.0)])
    qwen = fp8_kernels_record("2026-12-03T10:00:00+00:00", [
        ("wgrad_rows_n160_sorted_chain", "wgrad", 500.0), ("wgrad_rows_overlap", "wgrad", 600.0)])
    qwen["config"].update(G=128, K=768, N=2048, layout="dirichlet0.3")
    (d / "fp8_kernels-deepseek.json").write_text(json.dumps(deepseek))
    (d / "fp8_kernels-qwen.json").write_text(json.dumps(qwen))
    newest = report.newest_records(d, log=lambda _: None)
    name = "fp8_kernels:wgrad sweep M=65536 G=128 K=768 N=2048 dirichlet0.3"
    assert {k: p.name for k, (_, p) in newest.items()} == {
        "fp8_kernels:wgrad sweep": "fp8_kernels-deepseek.json", name: "fp8_kernels-qwen.json"}
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    assert ("- FP8 wgrad variant sweep (CUPTI): default wgrad_rows_n160_sorted_chain 732 TF/s "
            "(target 1100)") in text
    assert ("- FP8 wgrad variant sweep M=65536 G=128 K=768 N=2048 dirichlet0.3 (CUPTI): "
            "default wgrad_rows_n160_sorted_chain 500 TF/s, best wgrad_rows_overlap 600 TF/s\n") in text
    qwen_at = text.index("### wgrad variant sweep M=65536 G=128 K=768 N=2048 dirichlet0.3")
    assert "| wgrad_rows_overlap | wgrad | 1.000 | 1.100 | 600 | 550 | - |" in text[qwen_at:]
    assert "| wgrad_rows_n160_sorted_chain | wgrad | 1.000 | 1.100 | 732 | 682 | 1100: **not met** |" \
        in text[:qwen_at]


def tile_probe_record(created, shape, rows, dense=None, **config):
    """A ``gmm_tile_probe.py`` record: ``rows`` of (layout, product, tiling, fields) at
    ``shape`` (M, G, K, N); ``dense``: {product: fields} of the dense product there."""
    return {"kind": "gmm_tile_probe", "created": created, **PROV,
            "config": {"shapes": [list(shape)], "layouts": ["balanced", "dirichlet0.3"],
                       "products": ["fwd", "dgrad"], **config},
            "rows": [{"shape": list(shape), "layout": layout, "product": product, "tiling": tiling,
                      **fields} for layout, product, tiling, fields in rows],
            "dense": {",".join(map(str, shape)): dense} if dense else {}}


def tile_probe_row(tiles, overhead, kernel_ms, tf, vs_dense, block_m=128, chain=True, **extra):
    return {"tiling_config": {"block_m": block_m, "block_n": 128, "block_k": 64, "num_stages": 4,
                              "grid_tile_width": 8, "chain": chain},
            "tiles": tiles, "overhead": overhead, "kernel_ms": kernel_ms,
            "wall_ms": kernel_ms + 0.5, "tflops_kernel": tf, "tflops_wall": tf - 40.0, "vs_dense": vs_dense, **extra}


def test_gmm_tile_probe_section(tmp_path):
    """Each probe record (``gmm_tile_probe.py``'s layout) renders as its own table, the dense
    product leading each (shape, layout, product); the headline quotes the skewed fwd's best
    tiling against the table's and dense."""
    d = tmp_path / "r"
    d.mkdir()
    g256 = tile_probe_record("2026-12-03T17:19:05+00:00", (65536, 256, 7168, 4096), [
        ("balanced", "fwd", "table", tile_probe_row(512, 1.0, 5.5, 700.0, 0.94)),
        ("dirichlet0.3", "fwd", "table", tile_probe_row(727, 1.42, 8.0, 478.0, 0.64)),
        ("dirichlet0.3", "fwd", "m64_n128_w8", tile_probe_row(
            1238, 1.209, 7.8, 505.0, 0.675, block_m=64, chain=False, bitwise_equal_to="table",
            equal=False)),
        ("dirichlet0.3", "fwd", "m64_n128_w8_chain", tile_probe_row(
            1238, 1.209, 8.4, 456.0, 0.61, block_m=64, bitwise_equal_to="table", equal=True))],
        dense={"fwd": {"kernel_ms": 5.1, "wall_ms": 5.9, "tflops_kernel": 748.0,
                       "tflops_wall": 650.0}})
    g32 = tile_probe_record("2026-12-03T17:20:55+00:00", (65536, 32, 7168, 4096), [
        ("dirichlet0.3", "fwd", "table", tile_probe_row(540, 1.055, 5.3, 732.0, 0.94))])
    (d / "gmm_tile_probe-a.json").write_text(json.dumps(g256))
    (d / "gmm_tile_probe-b.json").write_text(json.dumps(g32))
    newest = report.newest_records(d, log=lambda _: None)
    assert {k: p.name for k, (_, p) in newest.items()} == {
        "gmm_tile_probe:M=65536 G=256 K=7168 N=4096 (balanced, dirichlet0.3; fwd, dgrad)":
            "gmm_tile_probe-a.json",
        "gmm_tile_probe:M=65536 G=32 K=7168 N=4096 (balanced, dirichlet0.3; fwd, dgrad)":
            "gmm_tile_probe-b.json"}
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    section = text[text.index("## Grouped GEMM row tiles under skew"):]
    g32_at = section.index("### M=65536 G=32 K=7168 N=4096")
    g256_at = section.index("### M=65536 G=256 K=7168 N=4096")
    assert g32_at < g256_at  # by shape
    g256_text = section[g256_at:]
    assert ("| 65536 256 7168 4096 | dirichlet0.3 | fwd | dense cuBLAS | - | - | 5.100 | 5.900 "
            "| 748 | 650 | 1.00x | - |") in g256_text
    assert ("| 65536 256 7168 4096 | dirichlet0.3 | fwd | table | 727 | 1.420 | 8.000 | 8.500 "
            "| 478 | 438 | 0.64x | ref |") in g256_text
    assert ("| 65536 256 7168 4096 | dirichlet0.3 | fwd | m64_n128_w8 | 1238 | 1.209 | 7.800 "
            "| 8.300 | 505 | 465 | 0.68x | **no** |") in g256_text
    assert ("`m64_n128_w8` 64 x 128 x 64, 4 stages, grid tile width 8; `m64_n128_w8_chain` 64 x "
            "128 x 64, 4 stages, grid tile width 8, chained.") in g256_text
    assert "`gmm_tile_probe-a.json`" in g256_text and "`gmm_tile_probe-b.json`" in section[:g256_at]
    assert ("- gmm row-tile probe fwd M=65536 G=256 K=7168 N=4096 dirichlet0.3 (CUPTI): best "
            "m64_n128_w8 505 TF/s = 1.06x the table's 478, 0.68x dense (748)") in text
    # No dense product in the record: the best is quoted against the table's alone.
    assert report.headlines("gmm_tile_probe", g32) == [
        "gmm row-tile probe fwd M=65536 G=32 K=7168 N=4096 dirichlet0.3 (CUPTI): best the "
        "table's tiling 732 TF/s"]


def test_gmm_tile_probe_record_missing_optional_fields(tmp_path):
    """A record without config or dense times, with a tiling skipped, one failed, a shape
    failed whole and a row of its kernel time alone, renders each with "-" where a number
    is missing."""
    d = tmp_path / "r"
    d.mkdir()
    record = {"kind": "gmm_tile_probe", "created": "2026-12-03T00:00:00+00:00", **PROV,
              "rows": [{"shape": [1024, 8, 512, 256], "layout": "balanced", "product": "fwd",
                        "tiling": "table", "tflops_kernel": 300.0},
                       {"shape": [1024, 8, 512, 256], "layout": "balanced", "product": "fwd",
                        "tiling": "m64_n256_w8_s2", "skipped": "does not divide the shape"},
                       {"shape": [1024, 8, 512, 256], "layout": "balanced", "product": "fwd",
                        "tiling": "m64_n128_w8", "error": "Mosaic GPU: smem | over\nlimit"},
                       {"shape": [2048, 8, 512, 256], "error": "OOM"}]}
    (d / "gmm_tile_probe-x.json").write_text(json.dumps(record))
    logged = []
    text = report.render(d, tmp_path / "R.md", log=logged.append).read_text()
    assert not [line for line in logged if "could not render" in line]
    assert ("### M=1024 G=8 K=512 N=256; M=2048 G=8 K=512 N=256 (balanced; fwd)") in text
    assert "| 1024 8 512 256 | balanced | fwd | table | - | - | - | - | 300 | - | - | ref |" in text
    assert ("| 1024 8 512 256 | balanced | fwd | m64_n256_w8_s2 | skipped: does not divide the "
            "shape | - | - | - | - | - | - | - |") in text
    assert "| m64_n128_w8 | error: Mosaic GPU: smem / over limit | - |" in text
    assert "| 2048 8 512 256 | - | - | - | error: OOM | - |" in text
    assert "| dense cuBLAS |" not in text and "Tilings (" not in text
    assert ("- gmm row-tile probe fwd M=1024 G=8 K=512 N=256 balanced (CUPTI): best the table's "
            "tiling 300 TF/s") in text


def test_fp8_kernels_records_older_than_the_default_schedule_quote_narrow():
    """Records made before the default schedule became ``wide_o192_n160`` timed only the
    ``narrow`` schedule's variants: the headlines quote those and say so (products,
    sustained, wgrad sweep). Where a record timed both, the default's are quoted, even
    where narrow's are faster."""
    old = fp8_kernels_record("2026-12-04T13:30:00+00:00", [
        ("rows_gtw8", "fwd", 1200.0), ("rows_gtw4", "fwd", 1250.0),
        ("wgrad_rows_overlap_sorted_chain", "wgrad", 850.0)])
    assert report.headlines("fp8_kernels", old) == [
        "FP8 kernels alone (CUPTI, default variants): fwd rows_gtw8 1200 TF/s (target 1250; "
        "narrow schedule), wgrad wgrad_rows_overlap_sorted_chain 850 TF/s (target 1100; narrow "
        "schedule)"]
    old["rows"] += [{"variant": "rows_gtw8", "product": "fwd", "kernel_ms": 1.3, "wall_ms": 1.4,
                     "tflops_kernel": 950.0, "tflops_wall": 900.0, "sustained": True}]
    assert report.headlines("fp8_kernels", old) == [
        "FP8 kernels under load (CUPTI, the narrow schedule's variants, run back to back): "
        "fwd 950 TF/s, 0.79x its short run's 1200"]
    sweep = fp8_kernels_record("2026-12-04T13:40:00+00:00", [
        ("wgrad_rows_overlap_sorted_chain", "wgrad", 850.0),
        ("wgrad_rows_overlap_sorted_chain_bf16", "wgrad", 880.0)])
    assert report.headlines("fp8_kernels", sweep) == [
        "FP8 wgrad variant sweep (CUPTI): narrow wgrad_rows_overlap_sorted_chain 850 TF/s, "
        "bf16 output, as trained wgrad_rows_overlap_sorted_chain_bf16 880 TF/s (target 1100)"]
    both = fp8_kernels_record("2026-12-06T03:00:00+00:00", [
        ("rows_gtw8", "fwd", 1300.0), ("rows_gtw8_o192", "fwd", 1290.0)])
    assert report.headlines("fp8_kernels", both) == [
        "FP8 kernels alone (CUPTI, default variants): fwd rows_gtw8_o192 1290 TF/s (target 1250)"]


def test_fp8_kernels_sustained_record_is_never_quoted_against_the_targets():
    """A ``--sustain`` probe run times each job twice; its headline pairs each default
    variant's loaded timing with its short run's, and quotes no target (the targets are
    short-run figures, as DeepSeek's published ones)."""
    rec = fp8_kernels_record("2026-12-04T13:30:00+00:00", [
        ("rows_gtw8_o192", "fwd", 1200.0), ("rows_gtw8_o192", "dgrad", 1180.0)])
    rec["rows"] += [{"variant": "rows_gtw8_o192", "product": p, "kernel_ms": 1.3, "wall_ms": 1.4,
                     "tflops_kernel": tf, "tflops_wall": tf - 50, "sustained": True}
                    for p, tf in (("fwd", 950.0), ("dgrad", 940.0))]
    assert report.headlines("fp8_kernels", rec) == [
        "FP8 kernels under load (CUPTI, default variants, run back to back): fwd 950 TF/s, "
        "0.79x its short run's 1200, dgrad 940 TF/s, 0.80x its short run's 1180"]


def test_fp8_kernels_sustained_and_other_shapes_render_beside_the_default(tmp_path):
    """A ``--sustain`` record and products records at other shapes do not replace the
    default shape's products record: each renders in its own subsection. The sustained
    table pairs each job's short run with its loaded run (TF/s, NVML's clock, the ratio),
    and its headline quotes the default variants; targets are quoted at the issue's
    shapes only (not at Qwen3's)."""
    d = tmp_path / "r"
    d.mkdir()
    default = fp8_kernels_record("2026-12-04T16:00:00+00:00", [
        ("rows_gtw8_o192", "fwd", 1205.0), ("rows_gtw8_o192", "dgrad", 1182.0)])
    g256 = fp8_kernels_record("2026-12-04T16:10:00+00:00", [("rows_gtw8_o192", "fwd", 1079.0)])
    g256["config"]["G"] = 256
    qwen = fp8_kernels_record("2026-12-04T16:20:00+00:00", [("rows_gtw8_o192", "fwd", 700.0)])
    qwen["config"].update(G=128, K=2048, N=768)
    clocks = lambda mhz: {"gpu_clocks": {"sm_mhz_median": mhz}}  # noqa: E731
    loaded = fp8_kernels_record("2026-12-04T15:41:02+00:00", [
        ("rows_gtw8_o192", "fwd", 1176.0), ("rows_gtw4", "fwd", 1100.0)])
    loaded["config"]["sustain_s"] = 8.0
    loaded["rows"][0].update(clocks(1980.0))
    loaded["rows"] += [
        {"variant": "rows_gtw8_o192", "product": "fwd", "kernel_ms": 1.2, "wall_ms": 1.3,
         "tflops_kernel": 1020.0, "tflops_wall": 980.0, "sustained": True, **clocks(1470.0)},
        {"variant": "rows_gtw4", "product": "fwd", "kernel_ms": 1.2, "wall_ms": 1.3,
         "tflops_kernel": 990.0, "tflops_wall": 950.0, "sustained": True}]
    for name, rec in [("a", default), ("b", g256), ("c", qwen), ("d", loaded)]:
        (d / f"fp8_kernels-{name}.json").write_text(json.dumps(rec))
    newest = report.newest_records(d, log=lambda _: None)
    assert {k: p.name for k, (_, p) in newest.items()} == {
        "fp8_kernels:products": "fp8_kernels-a.json",
        "fp8_kernels:products M=65536 G=256 K=7168 N=4096 balanced": "fp8_kernels-b.json",
        "fp8_kernels:products M=65536 G=128 K=2048 N=768 balanced": "fp8_kernels-c.json",
        "fp8_kernels:sustained": "fp8_kernels-d.json"}
    text = report.render(d, tmp_path / "R.md", log=lambda _: None).read_text()
    assert ("- FP8 kernels alone (CUPTI, default variants): fwd rows_gtw8_o192 1205 TF/s (target "
            "1250), dgrad rows_gtw8_o192 1182 TF/s (target 1250)") in text
    assert ("- FP8 kernels alone M=65536 G=256 K=7168 N=4096 balanced (CUPTI, default variants): "
            "fwd rows_gtw8_o192 1079 TF/s (target 1250)") in text
    assert ("- FP8 kernels alone M=65536 G=128 K=2048 N=768 balanced (CUPTI, default variants): "
            "fwd rows_gtw8_o192 700 TF/s\n") in text
    assert ("- FP8 kernels under load (CUPTI, default variants, after 8 s back to back): fwd 1020 "
            "TF/s at 1470 MHz, 0.87x its short run's 1176 at 1980 MHz\n") in text
    section = text[text.index("## FP8 grouped GEMM kernels"):]
    loaded_at = section.index("### Under load")
    assert "| rows_gtw8_o192 | fwd | 1176 | 1980 | 1020 | 1470 | 0.87x |" in section[loaded_at:]
    assert "| rows_gtw4 | fwd | 1100 | - | 990 | - | 0.90x |" in section[loaded_at:]
    qwen_at = section.index("### Products M=65536 G=128 K=2048 N=768 balanced")
    assert "| rows_gtw8_o192 | fwd | 1.000 | 1.100 | 700 | 650 | - |" in section[qwen_at:loaded_at]
    g256_at = section.index("### Products M=65536 G=256 K=7168 N=4096 balanced")
    assert "| rows_gtw8_o192 | fwd | 1.000 | 1.100 | 1079 | 1029 | 1250: **not met** |" in section[g256_at:]
    assert "| rows_gtw8_o192 | fwd | 1.000 | 1.100 | 1205 | 1155 | 1250: **not met** |" in section[:qwen_at]



def test_fp8_kernels_wgrad_sweep_at_an_issue_shape_is_quoted_against_the_target():
    """The issue sets the kernel targets at G=32 and 256 on both DeepSeek-V3 shapes: a wgrad
    sweep at G=256 is quoted against them, as the default shape's is (a Qwen3 one is not:
    ``test_fp8_kernels_sweeps_at_other_shapes_are_their_own_variant``)."""
    sweep = fp8_kernels_record("2026-12-04T15:44:43+00:00", [
        ("wgrad_rows_n160_sorted_chain", "wgrad", 479.0)])
    sweep["config"].update(G=256)
    assert report.headlines("fp8_kernels", sweep) == [
        "FP8 wgrad variant sweep M=65536 G=256 K=7168 N=4096 balanced (CUPTI): default "
        "wgrad_rows_n160_sorted_chain 479 TF/s (target 1100)"]


def test_a_record_cut_short_says_so_in_its_source_line(tmp_path):
    from dropless.perf.report_md import _source_line

    record = {"kind": "fp8_kernels", "created": "2026-12-05T00:00:00+00:00", "rows": []}
    assert "Cut short" not in _source_line(record, tmp_path / "a.json")
    assert "Cut short" not in _source_line({**record, "complete": True}, tmp_path / "a.json")
    assert "Cut short" in _source_line({**record, "complete": False}, tmp_path / "a.json")
