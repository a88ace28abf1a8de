"""Finding the project's `Questpie` from what `-A` says: the `Questpie` itself
(`module:attribute`), or what `celery -A` takes, whose Celery app's `Questpie` it is.
Mistakes are click errors that say what to write."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import click
from celery import Celery
from celery.app.utils import find_app

from ..app import Questpie, questpie_of
from ..errors import QuestpieError


def load_questpie(spec: str) -> Questpie:
    """The `Questpie` that `spec` names: `module:attribute` of the `Questpie` itself, or
    what `celery -A` takes (`proj`, `proj.celery`, `proj.celery:app`), whose Celery app's
    `Questpie` it is. A module alone means its `questpie` attribute when it has one,
    else the Celery app that Celery's own search finds there."""
    if "" not in sys.path:
        sys.path.insert(0, "")  # the working directory first, as celery -A has it
    module_name, colon, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
        if colon:
            value = getattr(module, attribute, None)
            if value is None:
                raise click.BadParameter(
                    f"module {module_name} has no attribute {attribute!r}", param_hint="--app"
                )
        else:
            value = getattr(module, "questpie", None)
            if not isinstance(value, Questpie):
                value = _celery_search(spec)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name + ".").startswith(exc.name + "."):
            raise  # the project's own import failed: its traceback is what helps
        raise click.BadParameter(
            f"no module named {exc.name} (run the command in the folder that holds it, or "
            "add that folder to PYTHONPATH)",
            param_hint="--app",
        ) from None
    except QuestpieError as exc:
        raise click.ClickException(f"importing {module_name}: {exc}") from exc
    if isinstance(value, Celery):
        found = questpie_of(value)
        if found is None:
            raise click.BadParameter(
                f"{spec!r} is a Celery app that no Questpie(...) was built for on import; "
                "name your Questpie instead (module:attribute)",
                param_hint="--app",
            )
        return found
    if not isinstance(value, Questpie):
        raise click.BadParameter(
            f"{spec!r} is neither a Questpie nor a Celery app", param_hint="--app"
        )
    return value


def _celery_search(module_name: str) -> object:
    """The Celery app `celery -A module_name` would run: `module.app`, `module.celery`,
    the `celery` submodule's, or any Celery app the module holds."""
    try:
        return find_app(module_name)
    except AttributeError:
        submodule = f"{module_name}.celery"
        if getattr(sys.modules[module_name], "__path__", None) and importlib.util.find_spec(
            submodule
        ):
            # Celery's search swallowed why this one failed to import: let it say.
            importlib.import_module(submodule)
        raise click.BadParameter(
            f"module {module_name} holds no Questpie named questpie and no Celery app; "
            "pass -A module:attribute",
            param_hint="--app",
        ) from None
