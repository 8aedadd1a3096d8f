"""The base of layers with a torch op and a Triton op: ``forward`` dispatches in one place."""

from __future__ import annotations

from torch import nn


class CustomOp(nn.Module):
    """A layer with two implementations of the same math: :meth:`forward_torch` (CPU and CUDA,
    plain torch) and :meth:`forward_triton` (CUDA, Triton kernels; they also run under Triton's
    interpreter on CPU in tests).

    Attributes:
        use_triton: which one :meth:`forward` runs; False until the model sets it from its
            attention backend (``AttentionBackend.uses_triton_kernels``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.use_triton = False

    def forward(self, *args, **kwargs):
        """Run :meth:`forward_triton` when :attr:`use_triton`, else :meth:`forward_torch`."""
        if self.use_triton:
            return self.forward_triton(*args, **kwargs)
        return self.forward_torch(*args, **kwargs)

    def forward_torch(self, *args, **kwargs):
        """The torch implementation."""
        raise NotImplementedError

    def forward_triton(self, *args, **kwargs):
        """The Triton implementation."""
        raise NotImplementedError
