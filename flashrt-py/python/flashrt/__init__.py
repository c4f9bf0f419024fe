"""flashrt from Python: models, sessions and execution-state capsules, in-process.

    import flashrt
    model = flashrt.Model("path/to/hf-checkpoint")          # backend="auto" | "cpu" | "cuda"
    s = model.session()
    s.append("The robot arm is at rest.")
    home = s.snapshot()                                      # the whole state, at copy speed
    for tok in s.generate(16, temperature=0):
        print(tok.text, end="", flush=True)
    s.restore(home)                                          # byte-exact, about one step

The device works with the GIL released. Errors raise `flashrt.Error` (the runtime's message),
`ValueError` for bad arguments, and `flashrt.CapsuleTypeError` (a `TypeError`) for a capsule
of another model.
"""

from ._native import (
    Capsule,
    CapsuleTypeError,
    Error,
    Generation,
    Model,
    Session,
    Token,
)

__all__ = [
    "Capsule",
    "CapsuleTypeError",
    "Error",
    "Generation",
    "Model",
    "Session",
    "Token",
]
__version__ = "0.1.0"
