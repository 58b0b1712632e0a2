"""A process-wide choice read once from an environment variable, which code inside :meth:`EnvSwitch.asking_for`
overrides (the innermost wins): the builds a plan's matrix classes take (:mod:`prefixattn.autotune.builds`) and
whether its launches chain by PDL (:mod:`prefixattn.autotune.pdl`). Read once because an environment read costs
~0.8 us on the 2-core host and every plan would pay it; overridable because the GPU check times several choices in
one process (and tests pin one). No torch or triton import here.
"""

from __future__ import annotations

import contextlib
import os


class EnvSwitch:
    """``env``'s value among ``choices`` (the variable's text -> the value it asks for; ``default``: the text when
    unset). ``asking_name`` names the override in its errors (the module's function that calls it)."""

    def __init__(self, env: str, choices: dict, default: str, asking_name: str) -> None:
        self.env, self.choices, self.default, self.asking_name = env, choices, default, asking_name
        self._stack: list = []  # the environment's request, read once; the overrides after it

    def requested(self):
        """The value asked for: the innermost :meth:`asking_for`, else the environment's (``ValueError`` naming the
        variable for a text it does not know)."""
        if not self._stack:
            text = os.environ.get(self.env, self.default)
            if text not in self.choices:
                raise ValueError(f"{self.env}: expected one of {', '.join(self.choices)}, got {text!r}")
            self._stack.append(self.choices[text])
        return self._stack[-1]

    @contextlib.contextmanager
    def asking_for(self, value):
        """Inside, :meth:`requested` is ``value`` (one of ``choices``' values, of their type: ``1`` is not ``True``)
        whatever the environment says."""
        if not any(type(value) is type(v) and value == v for v in self.choices.values()):
            raise ValueError(f"{self.asking_name}: expected one of {', '.join(map(str, self.choices.values()))}, "
                             f"got {value!r}")
        self.requested()  # the environment's value stays first
        self._stack.append(value)
        try:
            yield
        finally:
            self._stack.pop()
