"""Keys computed from a call's arguments: `ledger={"idempotency_key": "doc:{document_id}"}`.

A key option on an adopted task is a `str.format` template over the call's arguments,
bound by name to the task's signature (a positional argument fills its parameter's
name, a default fills what the call left out), or a callable taking the task's
arguments and returning the key (or None for "no key on this call"). A template that
names an argument the task does not have is refused when the task is defined, not when
it is first called.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import JobDefinitionError, PublishOptionsError

#: The options that may be computed from the arguments, in the order they are applied.
KEY_OPTIONS = ("idempotency_key", "singleton_key", "group_key")


class KeyTemplate:
    """How one key option is computed from a call's arguments."""

    def __init__(
        self, option: str, spec: str | Callable[..., Any], signature: inspect.Signature, task: str
    ) -> None:
        self.option = option
        self._signature = signature
        self._callable: Callable[..., Any] | None = None
        self._template: str | None = None
        if callable(spec):
            self._callable = spec
        elif isinstance(spec, str) and spec:
            self._template = spec
            _check_fields(option, spec, signature, task)
        else:
            raise JobDefinitionError(
                f"task {task!r}: ledger option {option} must be a str template over the "
                f"task's arguments or a callable, got {type(spec).__name__}"
            )

    def render(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        """The key of one call; a `PublishOptionsError` naming the option when the call's
        arguments cannot fill it (never quoting them: a key may be sensitive)."""
        if self._callable is not None:
            try:
                key = self._callable(*args, **kwargs)
            except Exception as exc:
                raise PublishOptionsError(
                    f"the {self.option} callable raised {type(exc).__name__}"
                ) from None
            if key is not None and not isinstance(key, str):
                raise PublishOptionsError(
                    f"the {self.option} callable returned a {type(key).__name__}, not a str"
                )
            return key
        assert self._template is not None
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{exc} (binding the arguments for {self.option})") from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        for parameter in self._signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                values.update(values.pop(parameter.name, {}))
        try:
            return self._template.format_map(values)
        except (KeyError, AttributeError, IndexError, ValueError) as exc:
            raise PublishOptionsError(
                f"{self.option} template could not be filled from the call ({type(exc).__name__})"
            ) from None


def _check_fields(option: str, template: str, signature: inspect.Signature, task: str) -> None:
    """Every field of `template` names a parameter of the task (or the task takes
    `**kwargs`, which may hold it)."""
    names = set(signature.parameters)
    open_keywords = any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
    )
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field]
    except ValueError as exc:
        raise JobDefinitionError(f"task {task!r}: {option} template is malformed: {exc}") from None
    for field in fields:
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root.isidentifier():
            raise JobDefinitionError(
                f"task {task!r}: {option} template field {{{field}}} must name an argument "
                f"(one of {', '.join(sorted(names)) or 'none'})"
            )
        if root not in names and not open_keywords:
            raise JobDefinitionError(
                f"task {task!r}: {option} template names {{{root}}}, which the task does not "
                f"take (its arguments: {', '.join(sorted(names)) or 'none'})"
            )
