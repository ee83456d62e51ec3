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
