"""Normalized RBF smoothing (Nadaraya-Watson): sum_j softmax_j(-gamma |x_i - t_j|^2) y_j.

The streamed version keeps an online softmax per query; gradients reach the
queries, the training points, the targets and gamma. Checked against dense.
Run: .venv/bin/python docs/examples/rbf_smoothing.py
"""
import torch

import lazytensor as lt

torch.manual_seed(0)
x_train = torch.rand(3000, 2, dtype=torch.float64).requires_grad_()
y_train = torch.cos(6 * x_train.detach()).requires_grad_()  # two target columns
x_query = torch.rand(501, 2, dtype=torch.float64).requires_grad_()
gamma = torch.tensor(40.0, dtype=torch.float64, requires_grad=True)

smooth = lt.kernel_regression(x_query, x_train, y_train, gamma)
dense = lt.kernel_regression(x_query, x_train, y_train, gamma, impl="dense")
torch.testing.assert_close(smooth, dense)

w = torch.randn_like(smooth)
inputs = [x_query, x_train, y_train, gamma]
grads = torch.autograd.grad((smooth * w).sum(), inputs)
grads_ref = torch.autograd.grad((dense * w).sum(), inputs)
for name, a, b in zip(["x_query", "x_train", "y_train", "gamma"], grads, grads_ref):
    torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d/d{name}: {m}")
print(f"RBF smoothing: {tuple(smooth.shape)} values and gradients for x_query, x_train, y_train, gamma match dense")
