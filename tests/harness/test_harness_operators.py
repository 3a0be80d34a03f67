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



def test_first_call_mode_times_fresh_processes_and_validates_them(tmp_path, capsys):
    """--first-call: one fresh child per variant and cache, calls timed with their peak memory, values checked."""
    out = tmp_path / "first.json"
    code = main(["operators", "--case", "rbf-matmul", "--n", "37", "--m", "29", "--d", "4", "--channels", "2",
                 "--dtype", "float64", "--first-call", "--calls", "2", "--cache", "cold", "--busy",
                 "--variants", "dense,generic", "--output", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["mode"] == "first-call" and record["busy"] is True
    rows = {r["variant"]: r for r in record["first_calls"]}
    assert set(rows) == {"dense", "generic"} and all(r["cache"] == "cold" for r in rows.values())
    assert len(rows["generic"]["seconds"]) == 2 and len(rows["generic"]["peak_bytes"]) == 2
    assert max(rows["generic"]["validation"].values()) < 1e-9
    assert "x dense mem" in capsys.readouterr().out  # no column name cut when the output is not a terminal
    assert main(["report", str(out)]) == 0


def test_busy_goes_with_first_call(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["operators", "--busy", "--output", str(tmp_path / "x.json")])
    assert exit_.value.code == 2
