"""pykeops's LazyTensor tutorials, unchanged, through lazytensor.keops: k-NN, k-means, Gaussian mixture, interpolation,
symbolic variables.

Run: .venv/bin/python docs/examples/keops_tutorials.py
"""
import torch

import lazytensor.keops

lazytensor.keops.install()  # `import pykeops` is now lazytensor.keops (the real pykeops, if installed, is set aside)
from pykeops.torch import LazyTensor, Pm, Vi, Vj  # noqa: E402 - after install(), as a client would

torch.manual_seed(0)
N, M, D, K = 2000, 300, 3, 5
x = torch.rand(N, D, dtype=torch.float64)
y = torch.rand(M, D, dtype=torch.float64)
labels = (y[:, 0] > 0.5).long()

# k-NN classification: the K nearest training points of every query, by KeOps's argKmin over j (axis 1)
D_ij = ((LazyTensor(x[:, None, :]) - LazyTensor(y[None, :, :])) ** 2).sum(-1)  # KeOps's default: a feature sum
knn = D_ij.argKmin(K, dim=1)
assert torch.equal(knn.long(), torch.cdist(x, y).topk(K, 1, largest=False).indices)
vote = labels[knn.long()].float().mean(1).round().long()

# k-means: ten Lloyd steps, assignments by argmin over the centroids (j)
c = x[:8].clone()
for _ in range(10):
    assign = ((Vi(x) - Vj(c)) ** 2).sum(-1).argmin(dim=1).long().view(-1)
    assert torch.equal(assign, torch.cdist(x, c).argmin(1))
    c = torch.zeros_like(c).index_add_(0, assign, x) / torch.bincount(assign, minlength=8).clamp_min(1)[:, None]

# Gaussian mixture log-likelihood: log sum_j w_j exp(-|x_i - mu_j|^2 / 2s^2), KeOps's logsumexp with weights
mu, w, s = c, torch.full((8, 1), 1 / 8, dtype=torch.float64), 0.1
log_lik = (-((Vi(x) - Vj(mu)) ** 2).sum(-1) / (2 * s * s)).logsumexp(dim=1, weight=Vj(w))
dense = torch.logsumexp(-torch.cdist(x, mu) ** 2 / (2 * s * s) + w.log().T, 1, keepdim=True)
torch.testing.assert_close(log_lik, dense)

# Kernel interpolation: solve (K + alpha I) a = b with KeOps's K.solve(Vi(b), alpha=...)
b = torch.sin(6 * y[:, :1])
K_yy = (-((Vi(y) - Vj(y)) ** 2).sum(-1) * 20.0).exp()
a = K_yy.solve(Vi(b), alpha=1e-2)
dense_a = torch.linalg.solve(torch.exp(-20.0 * torch.cdist(y, y) ** 2) + 1e-2 * torch.eye(M, dtype=torch.float64), b)
torch.testing.assert_close(a, dense_a, rtol=1e-8, atol=1e-8)

# Symbolic variables (KeOps's plot_lazytensors_c): the reduction is a function of the tensors, in index order
sigmas = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
x_s, y_s, b_s, s_s = Vi(0, D), Vj(1, D), Vj(2, 1), Pm(3, 3)
gamma = (LazyTensor.exp(-((x_s - y_s) ** 2).sum(-1) / s_s**2).sum() * b_s).sum_reduction(axis=1)
dense_gamma = sum(torch.exp(-torch.cdist(x, y) ** 2 / s**2) for s in sigmas) @ b
torch.testing.assert_close(gamma(x, y, b, sigmas), dense_gamma)

lazytensor.keops.uninstall()
print(f"keops tutorials: k-NN ({vote.float().mean():.2f} positive votes), k-means, mixture log-likelihood, "
      "interpolation and a symbolic-variable reduction match dense torch")
