"""``pyrobdl._grad.no_grad``: the same effect as ``@torch.no_grad()``, in every grad mode."""

from __future__ import annotations

import torch

from pyrobdl._grad import no_grad


@no_grad
def _modes(x: torch.Tensor) -> tuple[bool, bool, torch.Tensor]:
    """Documented."""
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), x * 2


def test_no_grad_turns_gradients_off_and_restores_them():
    x = torch.ones(3, requires_grad=True)
    grad_on, inference, y = _modes(x)
    assert not grad_on and not inference and not y.requires_grad
    assert torch.is_grad_enabled()  # restored after the call
    with torch.no_grad():
        assert _modes(x)[:2] == (False, False)
    with torch.inference_mode():  # left as it is: inference mode stays on (its tensors stay inference tensors)
        grad_on, inference, y = _modes(torch.ones(3))
        assert not grad_on and inference and y.is_inference()
    assert torch.is_grad_enabled()


def test_no_grad_restores_gradients_after_an_exception_and_keeps_the_name():
    @no_grad
    def boom() -> None:
        raise ValueError("inside")

    try:
        boom()
    except ValueError:
        pass
    assert torch.is_grad_enabled()
    assert _modes.__name__ == "_modes" and _modes.__doc__ == "Documented."


def test_jacobian_equals_jacrev_in_any_grad_mode():
    from pyrobdl._grad import jacobian

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)

    def f(t: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:  # [B, 2] from t [4, 3]
        h = torch.tanh(xb @ t.t())
        return torch.stack([h.sum(-1), (h * h).prod(-1)], -1)

    expected = torch.func.jacrev(f)(w, x)
    assert expected.shape == (5, 2, 4, 3)
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        with mode():
            jac = jacobian(f, w, x)
        assert jac.shape == expected.shape and torch.allclose(jac, expected, rtol=1e-12, atol=1e-14), mode
    with torch.inference_mode():  # inputs that are themselves inference tensors
        jac = jacobian(f, w.clone(), x.clone())
    assert torch.allclose(jac, expected, rtol=1e-12, atol=1e-14)
