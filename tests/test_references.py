"""pyrobdl.references: the compact store, its checksum, and scoring draws against it.

Most tests build a store from synthetic draws in a temporary folder (target scale y_mean = 3,
y_std = 2, so a scale mistake cannot hide); the last ones check the stores shipped in the package.
Exact tests use draws whose empirical quantiles are known in closed form (the stored quantiles
themselves, or the draws file's own draws): their only error is the stored float16 rounding,
measured at conversion.  The one Monte Carlo test derives its bound from the binomial law of
empirical quantiles (see ``test_resampled_from_stored_quantiles``).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from scipy import special, stats

from pyrobdl import references
from pyrobdl.diagnostics import Certification

C, D, N = 4, 500, 30
Y_MEAN, Y_STD = 3.0, 2.0


def _draws(passed: bool = True, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    # skewed, input-dependent posteriors of f on the model scale
    f = rng.normal(size=N) + rng.uniform(0.1, 1.0, N) * rng.gamma(3.0, 1.0, size=(C, D, N))
    failures = () if passed else ("function-space R-hat 1.05 > 1.01 at 3 of 30 points",)
    cert = Certification(passed, failures, "split", 1.003 if passed else 1.05, 900.0, 800.0, 0, 0.9, N, C, D)
    return {"f": f.astype(np.float32), "precision": rng.gamma(50.0, 0.2, size=(C, D)),
            "x_test": rng.normal(size=(N, 2)).astype(np.float32), "y_test": rng.normal(size=N).astype(np.float32),
            "y_mean": np.array(Y_MEAN), "y_std": np.array(Y_STD), "certification": json.dumps(cert.to_dict())}


@pytest.fixture(scope="module")
def draws() -> dict:
    return _draws()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, draws: dict):
    folder = tmp_path_factory.mktemp("store")
    path = folder / "syn_split0.draws.npz"
    np.savez_compressed(path, **draws)  # through a draws file on disk, as the build script does
    references.convert(path, "syn", 0, protocol={"model": "synthetic"}, root=folder)
    return folder


def _f_original(draws: dict) -> np.ndarray:
    return draws["f"].reshape(C * D, N).astype(np.float64) * Y_STD + Y_MEAN


def _noise_original(draws: dict) -> np.ndarray:
    return Y_STD / np.sqrt(draws["precision"].reshape(-1))


def _y_original(draws: dict) -> np.ndarray:
    return draws["y_test"].astype(np.float64) * Y_STD + Y_MEAN


# ------------------------------------------------------------------------------ the store
def test_available_and_load(root) -> None:
    assert references.available(root) == [("syn", 0)]
    ref = references.load("syn", 0, root=root)
    assert ref.quantiles.shape == (N, references.DEFAULT_LEVELS)
    assert np.all(np.diff(ref.quantiles, axis=1) >= 0)
    assert ref.certified and ref.certification.passed
    assert ref.protocol == {"model": "synthetic", "num_chains": C, "num_draws": D}
    assert ref.x_test is None and ref.y_test is None  # data not stored unless asked for


def test_stored_summary_matches_the_draws(root, draws) -> None:
    """Mean and sd within float32 rounding; quantiles within the float16 bound the docstring states."""
    ref = references.load("syn", 0, root=root)
    f = _f_original(draws)
    np.testing.assert_allclose(ref.mean, f.mean(0), rtol=1e-6)
    np.testing.assert_allclose(ref.sd, f.std(0, ddof=1), rtol=1e-6)
    q = np.quantile(f, (np.arange(100) + 0.5) / 100, axis=0, method="inverted_cdf").T
    err_in_sd = np.abs(ref.quantiles - q) / ref.sd[:, None]
    # float16: half a unit in the last place of |z| < 2^k is 2^(k - 11); plus float32 mean/sd (~1e-7)
    k = np.ceil(np.log2(np.abs(ref.zq.astype(np.float64)).max()))
    assert err_in_sd.max() <= 2.0 ** (k - 11) + 1e-6
    assert err_in_sd.max() == pytest.approx(ref.meta["rounding"]["quantile_max_in_sd"], rel=1e-3)
    np.testing.assert_allclose(ref.noise_sd_quantiles,
                               np.quantile(_noise_original(draws), ref.levels, method="inverted_cdf"), rtol=1e-6)


def test_reference_metrics_and_hashes(root, draws) -> None:
    ref = references.load("syn", 0, root=root)
    f, y = _f_original(draws), _y_original(draws)
    assert ref.meta["reference_metrics"]["rmse"] == pytest.approx(np.sqrt(np.mean((f.mean(0) - y) ** 2)), rel=1e-12)
    references.check_inputs("syn", 0, draws["x_test"], root=root)
    with pytest.raises(ValueError, match="x_test does not match"):
        references.check_inputs("syn", 0, draws["x_test"][::-1], root=root)


# ------------------------------------------------------------------------------ W2, exact cases
def test_stored_quantiles_as_draws_give_zero(root) -> None:
    """L draws equal to the L stored quantiles: their empirical quantiles at (i + 1/2)/L are exactly
    the stored ones, so W2 is 0 up to float64 rounding (levels i/L would be off by a bin)."""
    q = references.load("syn", 0, root=root).quantiles
    out = references.score("syn", 0, q.T, root=root)
    assert out["w2_function"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("delta", [0.05, -0.3])
def test_pure_shift_gives_delta(root, delta: float) -> None:
    ref = references.load("syn", 0, root=root)
    out = references.score("syn", 0, ref.quantiles.T + delta, root=root)
    assert out["w2_function"] == pytest.approx(abs(delta), rel=1e-9)
    assert out["w2_function_in_sd"] == pytest.approx(np.mean(abs(delta) / ref.sd), rel=1e-9)


def test_own_draws_within_rounding(root, draws) -> None:
    """The draws file's own draws: W2 at most the stored rounding error (triangle inequality);
    shifted by delta, W2 within that error of delta."""
    ref = references.load("syn", 0, root=root)
    floor = ref.meta["rounding"]["quantile_max_abs"]
    f = _f_original(draws)
    out = references.score("syn", 0, f, root=root)
    assert out["w2_function"] <= floor
    assert out["mean_error"] <= 1e-6 * np.abs(ref.mean).max() and out["sd_error"] <= 1e-6 * ref.sd.max()
    shifted = references.score("syn", 0, f + 0.2, root=root)
    assert abs(shifted["w2_function"] - 0.2) <= floor
    assert shifted["mean_error"] == pytest.approx(0.2, rel=1e-5)


@pytest.mark.parametrize("c", [0.5, 1.5])
def test_scaled_copy(root, draws, c: float) -> None:
    """f' = m + c (f - m) has quantiles m + c (q - m), so W2_n = |c - 1| sqrt(mean_i (q_i - m)^2)
    against the exact q, and within the stored rounding error against the stored quantiles."""
    ref = references.load("syn", 0, root=root)
    f = _f_original(draws)
    m = f.mean(0)
    q = np.quantile(f, ref.levels, axis=0, method="inverted_cdf")
    expected = np.mean(abs(c - 1.0) * np.sqrt(np.mean((q - m) ** 2, axis=0)))
    out = references.score("syn", 0, m + c * (f - m), root=root)
    assert abs(out["w2_function"] - expected) <= ref.meta["rounding"]["quantile_max_abs"]
    assert out["sd_error_relative"] == pytest.approx(abs(c - 1.0), rel=1e-5)


def test_model_scale_equals_original(root, draws) -> None:
    f_model = draws["f"].reshape(C * D, N)
    noise_model = 1.0 / np.sqrt(draws["precision"].reshape(-1))
    a = references.score("syn", 0, f_model, noise_sd_draws=noise_model, y_test=draws["y_test"], scale="model",
                         root=root)
    b = references.score("syn", 0, _f_original(draws), noise_sd_draws=_noise_original(draws),
                         y_test=_y_original(draws), root=root)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-9), key


# ------------------------------------------------------------------------------ W2, Monte Carlo
def _expected_w2_squared(q: np.ndarray, s: int) -> np.ndarray:
    """E[W2_n^2] for S iid draws uniform over the L atoms q[n, :] (sorted), exactly: the empirical
    quantile at p_i is the k-th order statistic, k = ceil(p_i S), and it is at most atom j exactly
    when at least k of the S draws fall at or below atom j: P = P(Binomial(S, (j + 1)/L) >= k)."""
    num = q.shape[1]
    k = np.ceil((np.arange(num) + 0.5) / num * s)
    cdf = stats.binom.sf(k[:, None] - 1, s, (np.arange(num)[None, :] + 1) / num)  # [i, j] P(J_i <= j)
    pmf = np.diff(np.concatenate([np.zeros((num, 1)), cdf], axis=1), axis=1)
    sq = (q[:, None, :] - q[:, :, None]) ** 2  # [n, i, j]
    return np.einsum("ij,nij->n", pmf, sq) / num


def test_resampled_from_stored_quantiles(root) -> None:
    """S iid draws from the stored quantiles (each an atom of mass 1/L), independently per input.
    Each W2_n has E[W2_n] <= b_n = sqrt(E[W2_n^2]) (Jensen) and Var(W2_n) <= E[W2_n^2], with
    E[W2_n^2] exact (binomial law above); the mean over N independent inputs is then below
    mean(b_n) + 4 sqrt(sum_n E[W2_n^2]) / N but for a 4-sd (normal approximation) event."""
    ref = references.load("syn", 0, root=root)
    q, s = ref.quantiles, 40_000
    rng = np.random.default_rng(1)
    f = np.take_along_axis(q.T, rng.integers(0, q.shape[1], size=(s, N)), axis=0)
    out = references.score("syn", 0, f, root=root)
    e2 = _expected_w2_squared(q, s)
    bound = np.mean(np.sqrt(e2)) + 4.0 * np.sqrt(e2.sum()) / N
    assert out["w2_function"] <= bound
    # the bound is tight enough to see half a bin of the quantile grid (levels i/L instead of (i+1/2)/L)
    half_bin = np.mean(np.sqrt(np.mean(np.diff(q, axis=1) ** 2 / 4, axis=1)))
    assert bound < half_bin


# ------------------------------------------------------------------------------ test log-likelihood
def test_test_ll_against_direct_computation(root, draws) -> None:
    rng = np.random.default_rng(2)
    f = _f_original(draws)[:300] + rng.normal(0.0, 0.1, size=(300, N))
    sd = _noise_original(draws)[:300]
    y = _y_original(draws)
    out = references.score("syn", 0, f, noise_sd_draws=sd, y_test=y, root=root)
    direct = np.mean([special.logsumexp(stats.norm.logpdf(y[n], f[:, n], sd)) - np.log(300) for n in range(N)])
    assert out["test_ll"] == pytest.approx(direct, rel=1e-12)
    full = np.mean([special.logsumexp(stats.norm.logpdf(y[n], _f_original(draws)[:, n], _noise_original(draws)))
                    - np.log(C * D) for n in range(N)])
    assert out["reference_test_ll"] == pytest.approx(full, rel=1e-12)
    fixed = references.score("syn", 0, f, noise_sd_draws=0.5, y_test=y, root=root)  # a scalar noise sd
    assert fixed["test_ll"] == pytest.approx(
        np.mean(special.logsumexp(stats.norm.logpdf(y, f, 0.5), axis=0) - np.log(300)), rel=1e-12)


def test_y_test_must_match(root, draws) -> None:
    y = _y_original(draws)
    f = _f_original(draws)
    for bad, what in ((y[::-1], "reversed"), (y + 1e-3, "perturbed"), (draws["y_test"], "model scale")):
        with pytest.raises(ValueError, match="y_test does not match"):
            references.score("syn", 0, f, noise_sd_draws=1.0, y_test=bad, root=root)


def test_synthetic_targets_match_to_the_machines_float32_rounding(tmp_path, draws) -> None:
    """A store that holds its (synthetic) targets accepts regenerated ones a few float32 ulps away (another
    CPU's math library: blr's targets on an AMD EPYC were 4 ulps from an Intel Xeon's), and still refuses a
    wrong order, scale or a 1e-3 perturbation; a store without its targets (real data) needs the hash."""
    path = tmp_path / "syn_split0.draws.npz"
    np.savez_compressed(path, **draws)
    references.convert(path, "syn", 0, protocol={"model": "synthetic"}, root=tmp_path, include_data=True)
    y, f = _y_original(draws), _f_original(draws)
    model = draws["y_test"].astype(np.float32)
    ulps = np.where(np.arange(N) % 7 == 0, 4, 0).astype(np.int32)  # 4 ulps at every 7th target, as seen
    nudged = (model.view(np.int32) + ulps).view(np.float32).astype(np.float64) * Y_STD + Y_MEAN
    assert references.load("syn", 0, root=tmp_path).y_test is not None
    out = references.score("syn", 0, f, noise_sd_draws=1.0, y_test=nudged, root=tmp_path)
    assert out["test_ll"] == pytest.approx(references.score("syn", 0, f, noise_sd_draws=1.0, y_test=y, root=tmp_path)["test_ll"], rel=1e-5)
    for bad in (y[::-1], y + 1e-3, draws["y_test"]):
        with pytest.raises(ValueError, match="y_test does not match"):
            references.score("syn", 0, f, noise_sd_draws=1.0, y_test=bad, root=tmp_path)
    # the module's store has no targets: the same few ulps are refused there
    hash_only = _hash_only_root(tmp_path, draws)
    with pytest.raises(ValueError, match="y_test does not match"):
        references.score("syn", 0, f, noise_sd_draws=1.0, y_test=nudged, root=hash_only)


def _hash_only_root(tmp_path, draws):
    folder = tmp_path / "hash_only"
    folder.mkdir()
    np.savez_compressed(folder / "d.npz", **draws)
    references.convert(folder / "d.npz", "syn", 0, protocol={"model": "synthetic"}, root=folder)
    return folder


# ------------------------------------------------------------------------------ integrity
def _rewrite(path, change) -> None:
    with np.load(path, allow_pickle=False) as z:
        entries = {k: z[k] for k in z.files}
    change(entries)
    np.savez_compressed(path, **entries)


def test_tampered_store_is_refused(root, tmp_path) -> None:
    def quantile(e):
        e["zq"] = e["zq"].copy()
        e["zq"][3, 50] += np.float16(0.01)

    def certification(e):
        meta = json.loads(str(e["meta"]))
        meta["certification"]["passed"] = not meta["certification"]["passed"]
        e["meta"] = np.array(json.dumps(meta, sort_keys=True))

    for change in (quantile, certification):
        shutil.copy(root / "syn_split0.npz", tmp_path / "syn_split0.npz")
        references.load("syn", 0, root=tmp_path)  # an unmodified copy loads
        _rewrite(tmp_path / "syn_split0.npz", change)
        with pytest.raises(ValueError, match="checksum"):
            references.load("syn", 0, root=tmp_path)
        with pytest.raises(ValueError, match="checksum"):
            references.score("syn", 0, np.zeros((5, N)), root=tmp_path)
    (tmp_path / "syn_split0.npz").write_bytes((root / "syn_split0.npz").read_bytes()[:-50])
    with pytest.raises(ValueError, match="cannot be read"):
        references.load("syn", 0, root=tmp_path)


def test_uncertified_draws_refused_unless_forced(tmp_path) -> None:
    bad = _draws(passed=False)
    with pytest.raises(ValueError, match="uncertified.*R-hat 1.05"):
        references.convert(bad, "syn", 1, protocol={}, root=tmp_path)
    assert references.available(tmp_path) == []
    references.convert(bad, "syn", 1, protocol={}, root=tmp_path, force=True)
    ref = references.load("syn", 1, root=tmp_path)
    assert not ref.certified and ref.meta["forced"]
    assert references.score("syn", 1, _f_original(bad), root=tmp_path)["certified"] is False


def test_malformed_draws_file(tmp_path, draws) -> None:
    for key, value, match in (("f", draws["f"][0], "'f' must be"), ("precision", draws["precision"][:, :3], "precision"),
                              ("y_test", draws["y_test"][:5], "y_test"), ("x_test", draws["x_test"][:5], "x_test")):
        with pytest.raises(ValueError, match=match):
            references.convert({**draws, key: value}, "syn", 0, protocol={}, root=tmp_path)
    nan_f = draws["f"].copy()
    nan_f[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="'f' has non-finite"):
        references.convert({**draws, "f": nan_f}, "syn", 0, protocol={}, root=tmp_path)
    with pytest.raises(ValueError, match=r"lacks \['certification'\]"):
        references.convert({k: v for k, v in draws.items() if k != "certification"}, "syn", 0, protocol={},
                           root=tmp_path)
    with pytest.raises(ValueError, match="name must match"):
        references.convert(draws, "Wine", 0, protocol={}, root=tmp_path)


# ------------------------------------------------------------------------------ bad input to score
@pytest.mark.parametrize("name,split", [("nope", 0), ("syn", 7), ("syn", -1), (3, 0), ("syn", "0")])
def test_unknown_reference_lists_what_exists(root, name, split) -> None:
    with pytest.raises(ValueError, match=r"no stored reference.*available: \('syn', 0\)"):
        references.score(name, split, np.zeros((5, N)), root=root)


def test_bad_draws_and_options(root, draws) -> None:
    f = _f_original(draws)
    nan = f.copy()
    nan[3, 4] = np.inf
    cases = [
        (dict(f_draws=f.T), "f_draws must have shape"), (dict(f_draws=f[:, :-1]), "f_draws must have shape"),
        (dict(f_draws=f[:1]), "f_draws must have shape"), (dict(f_draws=f[:, 0]), "f_draws must have shape"),
        (dict(f_draws=nan), "f_draws has 1 non-finite"),
        (dict(f_draws=f, noise_sd_draws=np.ones(7)), "noise_sd_draws must be"),
        (dict(f_draws=f, noise_sd_draws=-1.0), "noise_sd_draws must be finite and > 0"),
        (dict(f_draws=f, y_test=np.ones(N - 1)), "y_test must have shape"),
        (dict(f_draws=f, y_test=np.full(N, np.nan)), "y_test has non-finite"),
        (dict(f_draws=f, scale="log"), "scale must be one of"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            references.score("syn", 0, root=root, **kwargs)
    out = references.score("syn", 0, f[..., None], root=root)  # [S, N, 1] is accepted
    assert out["num_draws"] == C * D


# ------------------------------------------------------------------------------ the shipped stores
def test_shipped_stores_load_certified_with_their_data() -> None:
    """gap and blr (split 0) ship with the package; their checksums hold, they are certified at
    every test input, and the data the protocol's recipe regenerates are the stored ones (inputs bit for
    bit; targets to the float32 rounding of the machine's arithmetic)."""
    from pyrobdl import datasets

    assert {("blr", 0), ("gap", 0)} <= set(references.available())
    regenerate = {"gap": lambda o: datasets.gap_regression(o["num_train"], o["num_test"], noise_sd=o["noise_sd"], seed=0),
                  "blr": lambda o: datasets.bayesian_linear_regression(
                      o["num_train"], o["num_test"], o["in_features"], prior_scale=o["prior_scale"],
                      precision=o["precision"], seed=0)}
    for name, make in regenerate.items():
        ref = references.load(name, 0)
        assert ref.certified and ref.certification.num_points == ref.num_inputs
        data = make(ref.protocol["data"]["options"])
        references.check_inputs(name, 0, data.x_test)
        np.testing.assert_array_equal(ref.x_test, data.x_test.numpy())  # the generator's draws: every machine's
        y = data.y_test.double().numpy() * data.y_std + data.y_mean
        # the targets are float32 arithmetic on those draws (blr's x @ w, gap's sin), whose last bits are the
        # CPU's math library's: MKL rounds them differently on the AMD EPYC than on the Intel Xeon that wrote
        # the stores (blr: 3 of 100 targets, 4 ulps).  Bound: a few terms' float32 rounding, 8 ulps of their
        # magnitude (|x| @ |w| + |b| + |y| for blr; |sin| + 0.3 x^2 + |y| <= 2 + |y| for gap)
        if name == "blr":
            terms = np.abs(data.x_test.double().numpy()) @ np.abs(data.true_weight.double().numpy()) + abs(data.true_bias)
        else:
            terms = np.full(len(y), 2.0)
        bound = 8 * np.finfo(np.float32).eps * (terms + np.abs(y)) * data.y_std
        assert np.all(np.abs(ref.y_test - y) <= bound), np.max(np.abs(ref.y_test - y) / bound)
        out = references.score(name, 0, np.tile(ref.mean, (4, 1)), noise_sd_draws=1.0, y_test=y)
        assert out["rmse"] == pytest.approx(ref.meta["reference_metrics"]["rmse"], rel=1e-6)


def test_shipped_blr_reference_matches_the_exact_posterior() -> None:
    r"""The blr reference against the exact Gaussian posterior of f(x) = w.x + b.  An empirical
    quantile from draws with effective size E errs by about sd * sqrt(p(1-p)/E) / phi(z_p), so in
    reference-sd units E[W2_n^2 / sd_n^2] ~ b^2 = mean_i p_i(1-p_i)/phi(z_i)^2 / E, with E the
    smaller of the certified bulk and tail ESS.  mean_n W2_n/sd_n <= sqrt(mean_n W2_n^2/sd_n^2), a
    Gaussian quadratic form with mean ~b^2; even with one degree of freedom it exceeds 16 b^2 with
    probability 6e-5, so the bound is 4 b plus the stored rounding (in sd)."""
    from pyrobdl import datasets

    ref = references.load("blr", 0)
    o = ref.protocol["data"]["options"]
    data = datasets.bayesian_linear_regression(o["num_train"], o["num_test"], o["in_features"],
                                               prior_scale=o["prior_scale"], precision=o["precision"], seed=0)
    xt = np.concatenate([data.x_test.double().numpy(), np.ones((ref.num_inputs, 1))], axis=1)
    mu = xt @ data.posterior.mean.numpy()
    sd = np.sqrt(np.einsum("ni,ij,nj->n", xt, data.posterior.covariance.numpy(), xt))
    z = stats.norm.ppf(ref.levels)
    w2_in_sd = np.sqrt(np.mean((ref.quantiles - (mu[:, None] + sd[:, None] * z)) ** 2, axis=1)) / sd
    cert = ref.certification
    b = np.sqrt(np.mean(ref.levels * (1 - ref.levels) / stats.norm.pdf(z) ** 2)
                / min(cert.ess_bulk_min, cert.ess_tail_min))
    assert w2_in_sd.mean() <= 4 * b + ref.meta["rounding"]["quantile_max_in_sd"]
    # and the exact posterior's own draws score near zero through the public API
    rng = np.random.default_rng(3)
    exact = mu + sd * rng.standard_normal((20_000, ref.num_inputs))
    assert references.score("blr", 0, exact)["w2_function_in_sd"] <= 4 * b + 4 * np.sqrt(
        np.mean(ref.levels * (1 - ref.levels) / stats.norm.pdf(z) ** 2) / 20_000) + ref.meta["rounding"]["quantile_max_in_sd"]


WINE_SPLITS = sorted(s for name, s in references.available() if name == "wine")


def test_the_wine_references_shipped() -> None:
    """Split 0 at least; each split stored once (28 kB each)."""
    assert 0 in WINE_SPLITS and len(WINE_SPLITS) == len(set(WINE_SPLITS))


@pytest.mark.parametrize("split", WINE_SPLITS)
def test_shipped_wine_reference_scores_the_uci_split(data_dir, split) -> None:
    """Every shipped wine split (certified with both R-hats at all 160 test inputs) matches the
    standard split read from the data directory: its inputs' and targets' hashes, and its own
    RMSE from its mean."""
    from pyrobdl import datasets

    ref = references.load("wine", split)
    assert ref.certified and ref.certification.num_points == ref.num_inputs == 160
    assert ref.certification.rhat_method == "both" and ref.certification.chain_outliers["chains"] == []
    data = datasets.load_uci("wine", split, data_dir=str(data_dir))
    references.check_inputs("wine", split, data.x_test)
    y = data.y_test.double().numpy() * data.y_std + data.y_mean
    out = references.score("wine", split, np.tile(ref.mean, (4, 1)), noise_sd_draws=1.0, y_test=y)
    assert out["rmse"] == pytest.approx(ref.meta["reference_metrics"]["rmse"], rel=1e-6)
    assert out["w2_function_in_sd"] > 0.5  # a point mass at the mean is far from the posterior
    with pytest.raises(ValueError):
        references.check_inputs("wine", split, data.x_test[::-1].contiguous())
