import json

import pytest
import torch

from harness.polytope import TASK_BUILDERS, main_args_run


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


def test_cli_charges_every_evaluation_and_writes_json_and_plot(tmp_path):
    out = tmp_path / "cmp.json"
    code = main_args_run(["polytope", "--task", "rosenbrock", "--seeds", "0", "1", "--budget", "300", "--no-tune",
                          "--optimizers", "polytope-defaults", "polytope", "random-search", "spsa", "--output", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    for method, data in record["tasks"]["rosenbrock"].items():
        for run in data["runs"]:
            assert run["evaluations"] <= 300 and run["error"] is None
            if method.startswith("polytope"):
                assert run["evaluations"] >= 300 - 3  # the last step shrinks to what is left instead of stopping early
            assert run["curve"]["best"] == sorted(run["curve"]["best"], reverse=True)
    assert (tmp_path / "cmp.png").stat().st_size > 0
