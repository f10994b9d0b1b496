"""torch.compile'd parts of the draft's training step, compiled up front or in the background.

Why the background: compiling the draft layer's halves, the final norm and the loss chunk (forward and
backward) takes most of a cold start on a GPU, and nothing needs them compiled to train: the same code
runs eagerly. With `deferred`, a part runs eagerly from its first call on and keeps a copy of that call's
inputs; after the first optimizer step, `Background.start` compiles every part on those copies in a thread
of its own (forward and, through `torch.autograd.grad`, the backward, with no gradient left on any
parameter), under the grad and autocast modes of the recorded call, so the guards of what it builds match the
training thread's calls. Each part switches to its compiled code at its first call after that part is built;
`Background.ready` says when all are (a CUDA graph is captured only then). The compiled code computes what
the eager code computes, up to the rounding of fused kernels.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

_AUTOCAST_DEVICES = ("cpu", "cuda")


class CompiledOrEager:
    """A torch.compile'd function that falls back to eager, with one warning, if compiling fails; `deferred`:
    eager until `Background` has compiled it."""

    def __init__(self, fn: Any, name: str, deferred: bool = False) -> None:
        self.eager, self.name = fn, name
        self.compiled: Any = torch.compile(fn, dynamic=False)
        self.ready = not deferred  # whether calls take the compiled code
        self.example: tuple[tuple, dict[str, Any]] | None = None  # deferred: the first call's inputs and modes

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None and self.ready:
            try:
                return self.compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # a compiler bug must not end a training run
                self.fail(e)
        elif self.compiled is not None and self.example is None:
            self.example = tuple(_copy(a) for a in args), _modes()
        return self.eager(*args)

    def fail(self, e: BaseException) -> None:
        warnings.warn(f"torch.compile of {self.name} failed ({type(e).__name__}: {str(e)[:200]}); running it "
                      "eagerly", stacklevel=3)
        self.compiled, self.ready = None, True

    def build(self) -> None:
        """Compile on the recorded inputs (the background thread); the part takes the compiled code from its next
        call on, once this thread's work on the device is done and its tensors are released."""
        example, self.example = self.example, None
        try:
            self._run_compiled(*example)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - the training thread goes on eagerly
            self.fail(e)
            return
        del example  # the copies go before the training thread may capture a CUDA graph
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ready = True

    def _run_compiled(self, args: tuple, modes: dict[str, Any]) -> None:
        """The compiled forward on `args` under `modes` and, where it has one, its backward."""
        with _in_modes(modes):
            out = self.compiled(*args)
            outs = [o for o in (out if isinstance(out, tuple) else (out,))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            owner = getattr(self.eager, "__self__", None)
            wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            params = owner.parameters() if isinstance(owner, torch.nn.Module) else ()
            wrt += [p for p in params if p.requires_grad]
            if outs and wrt:  # compiles the backward; the gradients are returned and dropped, never accumulated
                torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)


class Background:
    """The deferred parts of one draft, compiled one after the other in a daemon thread."""

    def __init__(self) -> None:
        self.parts: list[CompiledOrEager] = []
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def add(self, part: CompiledOrEager) -> CompiledOrEager:
        self.parts.append(part)
        return part

    @property
    def ready(self) -> bool:
        if self.error is not None:
            raise self.error
        return all(p.ready for p in self.parts)

    def start(self) -> None:
        """Compile every part that has recorded its inputs (call after an optimizer step: all have by then)."""
        if self.thread is not None or self.ready:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the recorded copies are complete before another thread reads them
        self.thread = threading.Thread(target=self._run, name="eyas-compile", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for p in self.parts:
                if not p.ready and p.example is not None:
                    p.build()
        except BaseException as e:  # noqa: BLE001 - raised in the training thread by `ready`
            self.error = e

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
        _ = self.ready


def _copy(x: Any) -> Any:
    """A tensor's copy with its size, strides, dtype, device and requires_grad (what compiled code is guarded on)."""
    if not isinstance(x, torch.Tensor):
        return x
    y = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
    with torch.no_grad():
        y.copy_(x)
    return y.requires_grad_(x.requires_grad)


def _modes() -> dict[str, Any]:
    """The thread-local modes a compiled graph's guards read: grad mode and autocast per device."""
    return {"grad": torch.is_grad_enabled(),
            "autocast": {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES}}


class _in_modes:
    """Enter recorded modes in this thread."""

    def __init__(self, modes: dict[str, Any]) -> None:
        self.modes = modes
        self.stack: list[Any] = []

    def __enter__(self) -> None:
        self.stack = [torch.set_grad_enabled(self.modes["grad"])]
        for d, (on, dtype) in self.modes["autocast"].items():
            self.stack.append(torch.autocast(d, dtype=dtype, enabled=on))
        for m in self.stack:
            m.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self.stack):
            m.__exit__(*exc)
