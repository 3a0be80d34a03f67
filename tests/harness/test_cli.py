"""`python -m harness`: every user mistake exits 2 with one argparse-style line; Ctrl-C keeps what was measured."""
import json
import runpy
import sys

import pytest
import torch

import harness.operators as operators
import harness.polytope as polytope
from harness import method
from harness.__main__ import INTERRUPTED, main


@pytest.fixture
def files(tmp_path):
    """Paths the mistakes refer to: a list-shaped JSON file, a binary file, a plain file, a foreign record."""
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    (tmp_path / "binary.json").write_bytes(bytes(range(256)))
    (tmp_path / "broken.json").write_text('{"variants": ')
    (tmp_path / "plain").write_text("not a folder")
    (tmp_path / "ml.json").write_text(json.dumps({"command": "ml", "variants": {"streamed": {"name": "streamed"}}}))
    return tmp_path


# (argv, the flag the message names, a fragment of what it says is allowed); {tmp} is the files fixture.
MISTAKES = [
    # counts and sizes
    ("operators --n -5", "--n", "integer >= 1"),
    ("operators --n 12.5", "--n", "integer >= 1"),
    ("operators --m 0", "--m", "integer >= 1"),
    ("operators --d 0", "--d", "integer >= 1"),
    ("operators --channels 0", "--channels", "integer >= 1"),
    ("operators --threads 0", "--threads", "integer >= 1"),
    ("operators --repeats 0", "--repeats", "integer >= 1"),
    ("operators --warmup -1", "--warmup", "integer >= 0"),
    ("operators --chunk-size 0", "--chunk-size", "integer >= 1"),
    ("operators --seed -1", "--seed", "integer >= 0"),
    ("ml --case pca --components 0", "--components", "integer >= 1"),
    ("ml --case ridge --n 1", "--n", "integer >= 2"),
    ("ml --case lda --classes 1", "--classes", "integer >= 2"),
    ("ml --case ridge --gamma nan", "--gamma", "number > 0"),
    ("ml --case ridge --regularization 0", "--regularization", "number > 0"),
    ("ml --case ridge --rtol -0.001", "--rtol", "number > 0"),
    ("ml --case ridge --atol inf", "--atol", "number >= 0"),
    ("ml --case ridge --search-width -1", "--search-width", "integer >= 0"),
    ("forward --attention --seq 64 0", "--seq", "integer >= 1"),
    ("forward --profile --repeats 0", "--repeats", "integer >= 1"),
    ("polytope --task rosenbrock --budget 0", "--budget", "integer >= 1"),
    ("polytope --task rosenbrock --budget 10 --wall 0", "--wall", "number > 0"),
    # choices and names
    ("operators --case nope", "--case", "invalid choice"),
    ("operators --dtype float16", "--dtype", "invalid choice"),
    ("operators --variants dense,fast", "--variants", "unknown: fast"),
    ("operators --variants streamed", "--variants", "must include dense"),
    ("operators --device tpu", "--device", "cpu, cuda or cuda:INDEX"),
    ("ml --case nope", "--case", "invalid choice"),
    ("ml --n 64", "--case", "required"),
    ("ml --case ridge --variants ,", "--variants", "subset of"),
    ("polytope --task nope --budget 10", "--task", "invalid choice"),
    ("polytope --task rosenbrock --budget 10 --optimizers nope", "--optimizers", "invalid choice"),
    # paths
    ("operators --output {tmp}", "--output", "is a directory"),
    ("operators --output {tmp}/plain/out.json", "--output", "is not a directory"),
    ("operators --output /proc/no-such-dir/out.json", "--output", "not writable"),
    ("report {tmp}/binary.json", "FILE", "not a text file"),
    ("report {tmp}/list.json", "FILE", "holds a JSON list"),
    ("report {tmp}/broken.json", "FILE", "not valid JSON"),
    ("report {tmp}/missing.json", "FILE", "no such file"),
    ("report {tmp}", "FILE", "is a directory"),
    ("report /dev/null", "FILE", "not a regular file"),
    ("report {tmp}/ml.json --reference dense", "--reference", "no variant 'dense'"),
    ("polytope --merge missing.json", "--merge", "no such file"),
    ("polytope --merge {tmp}/ml.json", "--merge", "not a record written by python -m harness polytope"),
    ("polytope --task rosenbrock --budget 10 --output {tmp}/plain/x.json", "--output", "is not a directory"),
    # flags that do not go together
    ("operators --case distance-sum --batch 2", "--batch", "only the attention case"),
    ("ml --case ridge --m 5", "--m", "only landmark"),
    ("ml --case landmark --n 10 --m 20", "--m", "at most --n (10)"),
    ("ml --case pca --backward", "--backward", "only ridge and landmark"),
    ("ml --case lda --classes 3 --components 3", "--components", "at most --classes - 1 = 2"),
    ("ml --case svd --n 10 --m 4 --components 5", "--components", "min(--n, --m) = 4"),
    ("ml --case lda --n 4 --classes 5 --components 1", "--classes", "at most --n (4)"),
    ("forward", "--profile/--prefix/--attention", "choose exactly one"),
    ("forward --prefix --attention", "--profile/--prefix/--attention", "got --prefix, --attention"),
    ("forward --prefix --compile", "--profile/--prefix/--attention", "choose exactly one"),
    ("forward --profile --seq 16", "--seq", "applies to --attention only"),
    ("forward --attention --seeds 1 2", "--seeds", "applies to --prefix only"),
    ("polytope --task rosenbrock", "--budget", "required"),
    ("polytope --budget 10", "--task", "required"),
    ("polytope --merge {tmp}/ml.json --task rosenbrock", "--merge", "drop --task"),
    ("polytope --task rosenbrock --budget 10 --plot {tmp}/p.png", "--plot", "needs --output"),
    ("polytope --task rosenbrock --budget 10 --seeds 1 1", "--seeds", "each seed once"),
    ("polytope --task rosenbrock --budget 10 --seeds 100", "--tune-seed", "kept apart"),
]


def _must_not_run(*args, **kwargs):
    pytest.fail("a benchmark started before the mistake was reported")


def _fails_with_usage(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("line,flag,allowed", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_mistake_exits_2_with_one_line_naming_the_argument(line, flag, allowed, files, capsys, monkeypatch):
    monkeypatch.setattr(operators, "workload", _must_not_run)
    monkeypatch.setattr(polytope, "run_one", _must_not_run)
    message = _fails_with_usage(line.format(tmp=files).split(), capsys)
    command = line.split()[0]
    assert message.startswith(f"python -m harness {command}: error: argument {flag}: ") or (
        flag == "--case" and "required" in message), message
    assert allowed in message


@pytest.mark.parametrize("command", ["operators", "ml --case ridge", "forward --profile"])
def test_cuda_without_cuda_says_so(command, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = _fails_with_usage([*command.split(), "--device", "cuda"], capsys)
    assert "argument --device: 'cuda': this machine has no CUDA device" in message


def test_cuda_index_beyond_the_devices_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "has 1 CUDA device(s)" in _fails_with_usage(["operators", "--device", "cuda:3"], capsys)


def test_default_output_is_checked_before_any_work(tmp_path, capsys, monkeypatch):
    (tmp_path / "results").write_text("a file where the results folder should be")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(operators, "workload", _must_not_run)
    message = _fails_with_usage(["operators", "--n", "8"], capsys)
    assert "cannot write 'results/operators-rbf-matmul.json'" in message


def test_library_refusals_become_usage_errors(tmp_path, capsys, monkeypatch):
    """A ValueError the libraries raise for bad input is one line and exit 2, not a traceback."""
    def refuse(**kwargs):
        raise ValueError("chunk_size must be a positive int or None, got 7.5")

    monkeypatch.setattr(operators, "workload", refuse)
    message = _fails_with_usage(["operators", "--n", "8", "--output", str(tmp_path / "x.json")], capsys)
    assert message == "python -m harness operators: error: ValueError: chunk_size must be a positive int or None, got 7.5"


def test_no_or_unknown_command_exits_2(capsys):
    for argv in ([], ["benchmark"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    assert "invalid choice: 'benchmark'" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:'harness.__main__' found in sys.modules:RuntimeWarning")
def test_the_module_entry_point_exits_2_without_traceback(tmp_path, capsys, monkeypatch):
    """What ``python -m harness report LIST.json`` runs, in this process (a new interpreter costs seconds)."""
    (tmp_path / "list.json").write_text("[]")
    monkeypatch.setattr(sys, "argv", ["python -m harness", "report", str(tmp_path / "list.json")])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("harness", run_name="__main__")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("holds a JSON list; expected an object (a benchmark record)")


# ------------------------------------------------------------------ Ctrl-C
def _fake_operator_workload(interrupt_variant: str, at_call: int):
    """Variants that agree with the reference; one raises KeyboardInterrupt on its ``at_call``-th call."""
    def workload(name, **config):
        calls = 0

        def call():
            nonlocal calls
            calls += 1
            if name == interrupt_variant and calls == at_call:
                raise KeyboardInterrupt
            return torch.zeros(3), ()

        return call

    return workload


def test_ctrl_c_keeps_the_rounds_already_measured(tmp_path, monkeypatch, capsys):
    # streamed's calls: 1 validation, 2 first call, 3 round one, 4 round two -> interrupted in round two.
    monkeypatch.setattr(operators, "workload", _fake_operator_workload("streamed", 4))
    out = tmp_path / "partial.json"
    code = main(["operators", "--variants", "eager,dense,streamed", "--repeats", "5", "--warmup", "1", "--no-memory",
                 "--output", str(out)])
    assert code == INTERRUPTED and "interrupted" in capsys.readouterr().err
    record = json.loads(out.read_text())
    assert record["interrupted"] is True
    variants = record["variants"]
    assert len(variants["streamed"]["samples_s"]) == 1
    for name in ("eager", "dense", "streamed"):
        assert 1 <= len(variants[name]["samples_s"]) <= 2
        assert variants[name]["summary"]["median"] >= 0 and variants[name]["validation"] == {"value": 0.0}
    assert main(["report", str(out)]) == 0
    assert "interrupted: partial" in capsys.readouterr().out


def test_ctrl_c_during_validation_writes_the_record_without_timings(tmp_path, monkeypatch):
    monkeypatch.setattr(operators, "workload", _fake_operator_workload("streamed", 1))
    out = tmp_path / "partial.json"
    assert main(["operators", "--variants", "dense,streamed", "--no-memory", "--output", str(out)]) == INTERRUPTED
    record = json.loads(out.read_text())
    assert record["interrupted"] is True and not any(v["samples_s"] for v in record["variants"].values())


def test_ctrl_c_keeps_finished_optimizer_runs(tmp_path, monkeypatch):
    finished = []

    def run_one(task_name, method_name, seed, config, budget, wall):
        if len(finished) == 3:
            raise KeyboardInterrupt
        finished.append(seed)
        return {"seed": seed, "config": config, "final": 1.0 / (seed + 1), "evaluations": budget, "seconds": 0.1,
                "error": None, "curve": {"evaluations": [0, budget], "seconds": [0.0, 0.1], "best": [2.0, 1.0]}}

    monkeypatch.setattr(polytope, "run_one", run_one)
    out = tmp_path / "cmp.json"
    code = main(["polytope", "--task", "rosenbrock", "--budget", "10", "--seeds", "0", "1", "--no-tune",
                 "--optimizers", "random-search", "spsa", "--output", str(out)])
    assert code == INTERRUPTED
    record = json.loads(out.read_text())
    methods = record["tasks"]["rosenbrock"]
    assert record["interrupted"] is True
    assert [r["seed"] for r in methods["random-search"]["runs"]] == [0, 1]
    assert [r["seed"] for r in methods["spsa"]["runs"]] == [0]
    assert methods["spsa"]["summary"]["median"] == 1.0
    assert (tmp_path / "cmp.png").stat().st_size > 0


def test_run_variants_summarizes_the_samples_it_has_when_interrupted():
    rounds = []

    def slow():
        rounds.append(1)
        if len(rounds) == 3:  # first call, round one, then Ctrl-C in round two
            raise KeyboardInterrupt

    results = {}
    with pytest.raises(KeyboardInterrupt):
        method.run_variants({"only": slow}, repeats=10, warmup=1, results=results)
    assert len(results["only"].samples_s) == 1
    assert results["only"].summary["median"] == results["only"].samples_s[0]
