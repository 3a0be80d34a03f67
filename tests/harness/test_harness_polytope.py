import json

import pytest
import torch

from harness.__main__ import main
from harness.baselines import GRIDS, OPTIONAL_PACKAGES, RUNNERS, BudgetExhausted, Meter
from harness.tasks import TASK_BUILDERS


@pytest.mark.parametrize("name", sorted(TASK_BUILDERS))
def test_batched_objective_matches_the_module_and_is_deterministic(name):
    task = TASK_BUILDERS[name](0)
    again = TASK_BUILDERS[name](0)
    assert torch.equal(task.x0, again.x0)
    candidates = task.x0 + 0.01 * torch.randn(3, task.x0.numel(), dtype=task.x0.dtype)
    losses = task.objective(candidates)
    assert losses.shape == (3,) and torch.isfinite(losses).all()
    if task.model is not None:
        inputs, targets = task.data
        for row, loss in zip(candidates, losses):
            torch.nn.utils.vector_to_parameters(row, task.model.parameters())
            assert float(task.loss_fn(task.model(inputs), targets)) == pytest.approx(float(loss), rel=1e-10)


def test_cli_charges_every_evaluation_and_writes_json_plot_and_markdown(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    code = main(["polytope", "--task", "rosenbrock", "--seeds", "0", "1", "--budget", "300", "--no-tune", "--markdown",
                          "--optimizers", "polytope-defaults", "polytope", "random-search", "spsa", "--output", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "| rosenbrock (10, 300) | " in text and "against spsa: lower median on " in text
    record = json.loads(out.read_text())
    for method, data in record["tasks"]["rosenbrock"].items():
        for run in data["runs"]:
            assert run["evaluations"] <= 300 and run["error"] is None
            if method.startswith("polytope"):
                assert run["evaluations"] >= 300 - 3  # the last step shrinks to what is left instead of stopping early
            assert run["curve"]["best"] == sorted(run["curve"]["best"], reverse=True)
    assert (tmp_path / "cmp.png").stat().st_size > 0


class CountingMeter(Meter):
    """Records the size of every batch a method scores, to compare with what it was charged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []

    def __call__(self, candidates):
        losses = super().__call__(candidates)
        self.batches.append(candidates.shape[0])
        return losses


STEP_ONE = {"ngopt": {"sigma": 1.0}, "snes": {"stdev_init": 1.0}, "cem": {"stdev_init": 1.0}, "sep-cma": {"sigma0": 1.0}}


@pytest.mark.parametrize("method", sorted(STEP_ONE))
def test_generation_adapters_are_charged_every_candidate_and_improve(method):
    pytest.importorskip(OPTIONAL_PACKAGES[method])
    task = TASK_BUILDERS["quadratic"](0)
    meter = CountingMeter(task, 400)
    meter.observe(lambda: task.x0, force=True)
    with pytest.raises(BudgetExhausted):
        RUNNERS[method](task, meter, 0, {**GRIDS[method][0], **STEP_ONE[method]})  # the start is one unit off
    assert sum(meter.batches) == meter.evaluations <= 400
    assert len(set(meter.batches)) == 1 and meter.batches[0] > 1  # whole generations, one batch each
    assert meter.evaluations > 400 - meter.batches[0]  # stopped only when the next generation did not fit
    start, best = meter.curve[0][2], meter.curve[-1][2]
    assert best < 0.5 * start


def test_a_method_whose_package_is_missing_is_skipped_with_its_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(OPTIONAL_PACKAGES, "ngopt", "tp_no_such_package")
    out = tmp_path / "cmp.json"
    code = main(["polytope", "--task", "quadratic", "--seeds", "0", "--budget", "50", "--no-tune",
                          "--optimizers", "ngopt", "random-search", "--output", str(out)])
    assert code == 0
    assert "skipping ngopt: the optional package 'tp_no_such_package' is not installed" in capsys.readouterr().out
    assert list(json.loads(out.read_text())["tasks"]["quadratic"]) == ["random-search"]
