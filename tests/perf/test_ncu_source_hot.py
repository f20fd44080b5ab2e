"""``benchmarks/ncu_source_hot.py`` sums an Nsight Compute source page's stall samples."""

import gzip
import io

from dropless.perf.bench import load_module
from dropless.perf.measure import REPO_ROOT

HEADER = ('"Address","Source","# Samples","Instructions Executed","stall_barrier","stall_long_sb",'
          '"stall_wait","stall_barrier (Not Issued)"')
PAGE = "\n".join([
    '"Kernel Name","gmm_fp8_mosaic_gpu_kernel",',
    HEADER,
    '"0x7f00001000","      WARPGROUP.DEPBAR.LE gsb0, 0x0","60","100","60","0","0","55"',
    '"0x7f00001010","      FFMA R1, R2, R3, R1","10","6400","0","0","10","0"',
    '"0x7f00001020","      FFMA R4, R5, R3, R4","10","6400","0","0","10","0"',
    '"0x7f00001030","      @!P1  BRA 0x7f00001000","20","100","0","20","0","0"',
])


def test_samples_are_summed_by_reason_by_opcode_and_by_instruction(tmp_path):
    hot = load_module("ncu_source_hot", REPO_ROOT / "benchmarks")
    page = tmp_path / "ncu-source-fwd.csv.gz"
    with gzip.open(page, "wt") as f:
        f.write(PAGE)
    kernel, rows = hot.read_page(page)
    assert kernel == "gmm_fp8_mosaic_gpu_kernel" and len(rows) == 4
    # The "(Not Issued)" copies are a subset of the all-samples columns: not counted twice.
    assert hot.stall_columns(rows) == ["stall_barrier", "stall_long_sb", "stall_wait"]
    total, by_op, executed = hot.summarize(rows)
    assert dict(total) == {"stall_barrier": 60, "stall_long_sb": 20, "stall_wait": 20}
    assert sum(by_op["FFMA"].values()) == 20 and executed["FFMA"] == 12800
    assert hot.opcode("      @!P1  BRA 0x7f00001000") == "BRA"
    assert hot.opcode("QGMMA.64x128x32.F32.E4M3.E4M3 R24") == "QGMMA"
    out = io.StringIO()
    hot.report(page, top=2, out=out)
    text = out.getvalue()
    assert "100 samples, 4 instructions" in text
    assert "barrier 60.0%, long_sb 20.0%, wait 20.0%" in text
    # The hottest instruction first, with its share of all samples.
    hottest = text.split("hottest instructions:\n")[1].splitlines()
    assert "60.0%" in hottest[0] and "WARPGROUP.DEPBAR" in hottest[0]


def test_a_file_that_is_not_a_source_page_is_a_one_line_error(tmp_path, capsys):
    hot = load_module("ncu_source_hot", REPO_ROOT / "benchmarks")
    bad = tmp_path / "raw.txt"
    bad.write_text("not a csv page\n")
    assert hot.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not an ncu source page" in err and err.count("\n") == 1
