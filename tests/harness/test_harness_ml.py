"""`python -m harness ml`: checks before timing, JSON records, nonzero exit on failure."""
import argparse
import json

import pytest

import harness.ml as ml


def _run(tmp_path, *argv):
    parser = argparse.ArgumentParser()
    ml.register(parser.add_subparsers(dest="command"))
    out = tmp_path / "record.json"
    args = parser.parse_args(["ml", *argv, "--repeats", "1", "--warmup", "1", "--no-memory", "--output", str(out)])
    return args.func(args), json.loads(out.read_text())


@pytest.mark.parametrize("case,extra", [
    ("ridge", ["--backward", "--dense-direct"]),
    ("landmark", ["--m", "24", "--backward"]),
    ("pca", ["--dense-direct", "--variants", "stored,streamed,auto,sklearn"]),
    ("ridge", ["--variants", "streamed,sklearn"]),
    ("landmark", ["--m", "24", "--variants", "streamed,sklearn"]),
    ("lda", ["--classes", "3"]),
    ("svd", ["--m", "50"]),
])
def test_cases_validate_and_record(tmp_path, case, extra):
    code, record = _run(tmp_path, "--case", case, "--n", "96", "--d", "3", "--queries", "8", "--rank", "32", *extra)
    assert code == 0, record.get("error")
    variants = record["variants"]
    assert "streamed" in variants and ("sklearn" in variants or "stored" in variants)
    for name, res in variants.items():
        assert res["samples_s"] and res["summary"]["median"] > 0 and res["extra"]["cpu_s"]["median"] > 0
        assert max(res["validation"].values()) <= record["tolerance"]
        assert name == "sklearn" or res["extra"]["info"]["converged"]
        assert res["extra"]["source"] == {"auto": "direct", "sklearn": None}.get(name, name)  # the route that ran
    assert record["config"]["n"] == 96 and "environment" in record and "checksums" in record


def test_failed_check_exits_nonzero_without_timings(tmp_path):
    code, record = _run(tmp_path, "--case", "ridge", "--n", "64", "--d", "2", "--rtol", "1e-3",
                        "--check-tol", "1e-14")
    assert code == 1 and "validation failed" in record["error"]
    assert not any(v["samples_s"] for v in record["variants"].values())
    assert "validation failed" in record["variants"]["stored"]["error"]


@pytest.mark.parametrize("argv,fragment", [
    (["--case", "lda", "--variants", "streamed,sklearn"], "no lda"),
    (["--case", "ridge", "--backward", "--variants", "sklearn"], "not differentiable"),
])
def test_sklearn_variant_only_where_scikit_learn_has_the_estimator(tmp_path, argv, fragment):
    from harness import cli

    with pytest.raises(cli.UsageError, match=fragment):
        _run(tmp_path, *argv, "--n", "32")
