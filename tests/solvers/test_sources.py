"""Streamed products (lazytensor reductions) against an explicit matrix: every product, ragged tiles,
float32 tiles with float64 accumulation, gradients through lazytensor's streamed backward."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lazytensor as lt
from solvers import RBF, Matern, StoredKernel, StreamedKernel

from .test_kernels import reference


def _data(n, m, d, c, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=dtype), torch.randn(m, d, generator=g, dtype=dtype),
            torch.randn(m, c, generator=g, dtype=dtype), torch.randn(n, c, generator=g, dtype=dtype))


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 40), m=st.integers(1, 40), d=st.integers(1, 5), c=st.integers(1, 4),
       chunk=st.integers(1, 17))
def test_products_match_dense(n, m, d, c, chunk):
    X, Y, V, U = _data(n, m, d, c)
    kernel = Matern(2.5, 0.5)
    K = reference(kernel, X, Y)
    S = StreamedKernel(kernel, X, Y, chunk_size=chunk)
    assert S.shape == (n, m) and S.dtype == torch.float64
    torch.testing.assert_close(S @ V, K @ V, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S.T @ U, K.T @ U, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S.gram(V), K.T @ (K @ V), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S @ V[:, 0], K @ V[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S.squared_row_norms(), K.square().sum(1), rtol=1e-12, atol=1e-12)
    idx = torch.tensor([0, m - 1])
    torch.testing.assert_close(S.columns(idx), K[:, idx], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S.dense(), K, rtol=1e-12, atol=1e-12)


def test_square_source_diag_and_stored_equivalence():
    X, _, V, _ = _data(37, 37, 3, 2)
    S = StreamedKernel(RBF(0.4), X, chunk_size=5)
    D = StoredKernel(reference(RBF(0.4), X, X))
    torch.testing.assert_close(S.diag(), D.diag())
    for square in (S.T, D.T, StreamedKernel(RBF(0.4), X, X)):  # a transpose and Y given as X itself are square too
        torch.testing.assert_close(square.diag(), D.diag())
    torch.testing.assert_close(S @ V, D @ V)
    torch.testing.assert_close(S.T @ V, D.T @ V)
    with pytest.raises(ValueError, match="square"):
        StreamedKernel(RBF(0.4), X, X[:5]).diag()


def test_float32_tiles_accumulate_in_float64():
    X, _, V, _ = _data(300, 300, 8, 2)
    exact = StreamedKernel(RBF(1 / 8), X) @ V
    fast = StreamedKernel(RBF(1 / 8), X, tile_dtype=torch.float32, chunk_size=64) @ V
    single = (StreamedKernel(RBF(1 / 8), X.float(), chunk_size=64) @ V.float()).double()
    assert fast.dtype == torch.float64
    err = ((fast - exact).abs().max() / exact.abs().max()).item()
    assert 1e-12 < err < 1e-6  # single-precision entries, double accumulation
    assert err < ((single - exact).abs().max() / exact.abs().max()).item()


def test_product_gradients_stream():
    X, Y, V, _ = _data(9, 7, 2, 3)
    gamma = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)

    def f(x, y, v, g):
        return StreamedKernel(Matern(1.5, g), x, y, chunk_size=4) @ v

    def f_t(x, y, u, g):
        return StreamedKernel(Matern(1.5, g), x, y, chunk_size=4).T @ u

    inputs = [t.clone().requires_grad_() for t in (X, Y, V)] + [gamma]
    torch.autograd.gradcheck(f, inputs)
    torch.autograd.gradcheck(f_t, inputs[:2] + [torch.randn(9, 2, dtype=torch.float64, requires_grad=True), gamma])


def test_gradients_reach_tensors_a_user_formula_closes_over():
    X, Y, V, _ = _data(11, 8, 3, 2)
    w = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64, requires_grad=True)

    def f(w, x):  # an anisotropic kernel: weighted squared distance
        return StreamedKernel(lambda a, b: (-(a - b).weightedsqnorm(lt.Pm(w))).exp(), x, Y) @ V

    torch.autograd.gradcheck(f, (w, X.clone().requires_grad_()))


def test_bad_inputs():
    X, Y, V, _ = _data(5, 4, 2, 1)
    S = StreamedKernel(RBF(1.0), X, Y)
    with pytest.raises(ValueError, match="4 rows"):
        S @ torch.ones(5, 1, dtype=torch.float64)
    with pytest.raises(TypeError, match="dtype"):
        S @ V.float()
    with pytest.raises(TypeError, match="V must be a torch.Tensor"):
        S @ [1.0]
    with pytest.raises(ValueError, match="features"):
        StreamedKernel(RBF(1.0), X, torch.randn(3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="chunk_size"):
        StreamedKernel(RBF(1.0), X, chunk_size=0)
    with pytest.raises(ValueError, match="X must be a floating"):
        StreamedKernel(RBF(1.0), torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="tile_dtype"):
        StreamedKernel(RBF(1.0), X, tile_dtype=torch.float16)


def test_composed_operators_match_their_dense_matrices():
    from solvers import RBF, Centred, Normal, Shifted, StoredKernel

    g = torch.Generator().manual_seed(3)
    X, L = torch.randn(23, 3, generator=g, dtype=torch.float64), torch.randn(7, 3, generator=g, dtype=torch.float64)
    K, Knm, Kmm = RBF(0.4)(X), RBF(0.4)(X, L), RBF(0.4)(L)
    V, W = torch.randn(23, 2, generator=g, dtype=torch.float64), torch.randn(7, 2, generator=g, dtype=torch.float64)
    H = torch.eye(23, dtype=torch.float64) - 1 / 23
    for source in (StreamedKernel(RBF(0.4), X), StoredKernel(K)):
        assert torch.allclose(Shifted(source, 0.3) @ V, (K + 0.3 * torch.eye(23, dtype=torch.float64)) @ V)
        assert torch.allclose(Centred(source) @ V, H @ K @ H @ V)
        assert torch.allclose(Shifted(source, 0.3).T @ V, Shifted(source, 0.3) @ V)
    normal = Normal(StreamedKernel(RBF(0.4), X, L), StreamedKernel(RBF(0.4), L), 0.2)
    assert normal.shape == (7, 7) and torch.allclose(normal @ W, (Knm.T @ Knm + 0.2 * Kmm) @ W)
    with pytest.raises(ValueError, match="square"):
        Shifted(StreamedKernel(RBF(0.4), X, L), 1.0)
    with pytest.raises(ValueError, match="Normal needs B of shape"):
        Normal(StreamedKernel(RBF(0.4), X, L), StoredKernel(K), 0.1)


def test_row_gram_is_the_normal_matrix_of_the_rows(monkeypatch):
    """K[idx]^T K[idx] over blocks of rows (a ragged last block), streamed, float32 tiles and stored."""
    import solvers.sources
    from solvers import StoredKernel

    X, Y, _, _ = _data(61, 19, 3, 1)
    K = reference(RBF(0.5), X, Y)
    idx = torch.tensor([0, 3, 4, 17, 40, 41, 60])
    want = K[idx].T @ K[idx]
    monkeypatch.setattr(solvers.sources, "ROW_BLOCK_BYTES", 3 * 19 * 8)  # three rows a block
    monkeypatch.setattr(solvers.sources, "GRAM_MIN_WIDTH", 4)  # four column blocks of 4-5 columns
    streamed = StreamedKernel(RBF(0.5), X, Y)
    torch.testing.assert_close(streamed.row_gram(idx), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(streamed.with_tile_dtype(torch.float32).row_gram(idx), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(StoredKernel(K).row_gram(idx), want, rtol=1e-12, atol=1e-12)
    assert streamed.row_gram(idx[:0]).abs().max() == 0 and streamed.row_gram(idx[:0]).shape == (19, 19)


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(0, 9), max_size=4), size=st.integers(0, 300),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_symmetric_gram_is_the_sum_of_the_blocks_normal_matrices(rows, size, dtype):
    """Only the upper column blocks are multiplied: the mirrored result must still be every block's B^T B summed,
    exactly symmetric, for sizes that split into 1-4 uneven column blocks, blocks of no rows and no blocks at all."""
    from solvers.sources import symmetric_gram

    g = torch.Generator().manual_seed(size)
    blocks = [torch.randn(r, size, generator=g, dtype=torch.float64) for r in rows]
    want = sum((b.T @ b for b in blocks), torch.zeros(size, size, dtype=torch.float64))
    got = symmetric_gram(iter(blocks), size, dtype, None)
    assert got.dtype == dtype and got.shape == (size, size)
    assert torch.equal(got, got.T)
    single = dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5 if single else 1e-12, atol=1e-4 if single else 1e-11)


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_gram_is_one_pass_with_padded_tiles(backend):
    """K^T (K V) from one pass (each tile evaluated once): odd sizes pad rows and columns of compiled tiles."""
    from lazytensor import engine
    from lazytensor.reductions.normal import normal_product

    X, Y, V, _ = _data(203, 37, 3, 2)
    K = reference(RBF(0.5), X, Y)
    S = StreamedKernel(RBF(0.5), X, Y)
    before = sum(engine.routes.values())
    got = normal_product(S.K * lt.Vj(V), backend=backend, chunk_size=16)
    assert sum(engine.routes.values()) == before + 1
    torch.testing.assert_close(got, K.T @ (K @ V), rtol=1e-12, atol=1e-12)
    fast = S.with_tile_dtype(torch.float32).gram(V)  # float32 tiles, products and state in float64
    assert fast.dtype == torch.float64
    torch.testing.assert_close(fast, K.T @ (K @ V), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize("dtype_acc", [None, torch.float64])
def test_normal_product_ignores_what_a_formula_makes_of_padding(backend, dtype_acc):
    """Kernel NaN and weights infinite at zero-padded columns (y = 0), ragged rows and columns: exact."""
    from lazytensor.reductions.normal import normal_product

    X, Y, V, _ = _data(45, 21, 3, 2, dtype=torch.float32)
    x, y = lt.Vi(X), lt.Vj(Y)
    K = (-x.sqdist(y)).exp() + (x | y) / y.sqnorm2()
    W = lt.Vj(V) / lt.Vj(Y[:, :1])
    got = normal_product(K * W, backend=backend, dtype_acc=dtype_acc)  # compiled: columns padded to 32
    Xd, Yd = X.double(), Y.double()
    Kd = torch.exp(-torch.cdist(Xd, Yd).square()) + Xd @ Yd.T / Yd.square().sum(1)
    want = Kd.T @ (Kd @ (V.double() / Yd[:, :1]))
    assert got.dtype == (dtype_acc or torch.float32) and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=0)


def test_normal_product_refuses_what_it_cannot_fuse():
    from lazytensor.reductions.normal import normal_product

    X, Y, V, U = _data(20, 7, 3, 2)
    K = (-lt.Vi(X).sqdist(lt.Vj(Y))).exp()
    with pytest.raises(ValueError, match="K_ij \\* W_j"):
        normal_product(K * lt.Vi(U))  # weights on the i side
    with pytest.raises(ValueError, match="K_ij \\* W_j"):
        normal_product(K)
    with pytest.raises(TypeError, match="LazyTensor"):
        normal_product(torch.ones(3, 3))
    empty = StreamedKernel(RBF(0.5), X[:0], Y).gram(V)
    assert empty.shape == (7, 2) and not empty.any()
