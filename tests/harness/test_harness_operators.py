"""`python -m harness operators` and `report`: every case validates, records JSON and fails loudly."""
import json

import pytest

from harness.__main__ import main

CASES = ["distance-sum", "rbf-matmul", "distance-quantile", "kernel-regression", "attention"]


def _operators(tmp_path, case, *extra):
    out = tmp_path / f"{case}.json"
    code = main(["operators", "--case", case, "--n", "37", "--m", "29", "--d", "4", "--channels", "2", "--repeats", "1",
                 "--warmup", "0", "--no-memory", "--dtype", "float64", "--variants", "eager,dense,streamed,event-stream",
                 "--output", str(out), *extra])
    return code, json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_every_case_validates_values_and_gradients_before_timing(tmp_path, case):
    code, record = _operators(tmp_path, case, "--backward")
    assert code == 0
    variants = record["variants"]
    for name in ("eager", "dense", "streamed"):
        assert variants[name]["error"] is None
        assert variants[name]["summary"]["median"] > 0
        assert max(variants[name]["validation"].values()) < 1e-9
    assert record["environment"]["torch"] and record["config"]["backward"] is True


def test_report_prints_markdown_and_flags_failures(tmp_path, capsys):
    _operators(tmp_path, "rbf-matmul")
    path = tmp_path / "rbf-matmul.json"
    assert main(["report", str(path), "--markdown"]) == 0
    text = capsys.readouterr().out
    assert "| variant | median s |" in text and "| streamed |" in text
    record = json.loads(path.read_text())
    record["variants"]["streamed"] = {"name": "streamed", "error": "BenchmarkError: relative error 1e-01 above 1e-09"}
    path.write_text(json.dumps(record))
    assert main(["report", str(path)]) == 1

