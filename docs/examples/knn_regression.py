"""k-NN regression without an N x M distance matrix, checked against the dense twin.

Run: .venv/bin/python docs/examples/knn_regression.py
"""
import torch

import lazytensor as lt

torch.manual_seed(0)
x_train = torch.randn(5000, 3, dtype=torch.float64)
y_train = (torch.sin(3 * x_train[:, :1]) + 0.1 * torch.randn(5000, 1, dtype=torch.float64)).requires_grad_()
x_query = torch.randn(777, 3, dtype=torch.float64)

pred = lt.knn_regression(x_query, x_train, y_train, k=8)  # streamed: running top-8 per query
ref = lt.knn_regression(x_query, x_train, y_train, k=8, impl="dense")  # cdist + topk
torch.testing.assert_close(pred, ref)

# The neighbour sets are piecewise constant, so the gradient flows to the targets only.
w = torch.randn_like(pred)
(g,) = torch.autograd.grad((pred * w).sum(), y_train)
(g_ref,) = torch.autograd.grad((ref * w).sum(), y_train)
torch.testing.assert_close(g, g_ref)
print(f"k-NN regression: {tuple(pred.shape)} predictions and target gradients match dense")
