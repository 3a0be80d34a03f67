"""benchmarks/scripts.py (issue 42's user-scripts benchmark): fresh processes, JSON lines, the results of both variants agree."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "scripts.py")


@pytest.mark.slow  # ~40 s on 2 busy cores (fresh interpreters; the KDE kernel is built once into .cache/inductor)
def test_tiny_scripts_agree_with_dense(tmp_path):
    docs = tmp_path / "page.md"
    docs.write_text("before\n<!-- benchmarks/scripts.py: begin -->\nold\n<!-- benchmarks/scripts.py: end -->\nafter\n")
    done = subprocess.run([sys.executable, SCRIPT, "--scale", "0.02", "--scripts", "kmeans,kde", "--threads", "1",
                           "--docs", str(docs)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["script"], r["variant"]) for r in records] == [
        ("kmeans", "dense"), ("kmeans", "lazytensor"), ("kde", "dense"), ("kde", "lazytensor")]
    for record in records:
        assert "error" not in record, record["error"]
        assert record["seconds"] > 0 and record["threads"] == 1 and len(record["samples_s"]) == 1
    for record in records[1::2]:
        assert record["cache"] == "warm" and record["prepare_s"] > 0
        assert record["agree"] is True, record
    assert records[1]["labels_differ"] == 0 and records[1]["sizes"] == {"n": 1000, "k": 50}
    page = docs.read_text()
    assert page.startswith("before\n") and page.endswith("after\n") and "old" not in page
    assert "| Gaussian KDE, 400 x 400, 3-D |" in page and page.count("| yes (") == 2
