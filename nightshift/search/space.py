"""The search space: trainer options mapped to Optuna distributions, checked before any trial runs.

A space is a JSON object. Each key is a trainer option (`lr`, `batch_size`, `momentum`, `model`, `seed`,
`precision`, `compression`) or a model argument (`model_kwargs.channels`); each value is
`{"type": "float", "low": L, "high": H [, "log": true] [, "step": S]}`, the same with `"type": "int"`, or
`{"type": "categorical", "choices": [...]}` (choices: null, booleans, numbers or strings). The options
that every trial shares (`fixed`) use the same keys, plus `dataset`, `dataset_options`, `task`, `threads`,
`device`, `checkpoint_every`, `keep_checkpoints` and `log_every` (a pipeline's search fixes the dataset, its
options, the task and the model from the declaration, `nightshift.search.pipeline`). Epochs are the
search's `max_epochs`.

`parse_space` refuses a malformed entry or an unknown option naming the key, and tries the ends of
every range (and every choice) against `TrainConfig`'s own checks, so `momentum` up to 1.5 is refused
here rather than failing every trial.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nightshift.errors import UsageError
from nightshift.plugins import keyword_arguments
from nightshift.search.errors import SearchSpaceInvalid

if TYPE_CHECKING:
    import optuna

MODEL_KWARGS = "model_kwargs."
# Options a search may vary, with the kind of value each takes.
TUNABLE = {"lr": "number", "batch_size": "int", "momentum": "number", "seed": "int", "model": "str",
           "precision": "str", "compression": "str"}
# Options a search may fix for every trial, besides the tunable ones.
FIXED_ONLY = {"dataset": "str", "dataset_options": "object", "task": "str", "threads": "int", "device": "str",
              "checkpoint_every": "int", "keep_checkpoints": "int", "log_every": "int"}
TYPES = ("float", "int", "categorical")
FIELDS = {"float": {"type", "low", "high", "log", "step"}, "int": {"type", "low", "high", "log", "step"},
          "categorical": {"type", "choices"}}
# The model arguments the trainer itself passes.
RESERVED_MODEL_ARGS = ("input_shape", "num_classes")


@dataclass(frozen=True)
class Dimension:
    """One searched option and its distribution."""

    key: str
    type: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] = ()

    def candidates(self) -> list[Any]:
        """The values whose validity stands for the whole distribution: both ends, or every choice."""
        return list(self.choices) if self.type == "categorical" else [self.low, self.high]

    def suggest(self, trial: optuna.Trial) -> Any:
        if self.type == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.type == "int":
            return trial.suggest_int(self.key, int(self.low or 0), int(self.high or 0), step=int(self.step or 1),
                                     log=self.log)
        return trial.suggest_float(self.key, float(self.low or 0), float(self.high or 0), step=self.step,
                                   log=self.log)


@dataclass(frozen=True)
class SearchSpace:
    """The parsed space and the options every trial shares, as flat keys (`model_kwargs.x`)."""

    dimensions: tuple[Dimension, ...]
    fixed: dict[str, Any]

    @property
    def keys(self) -> list[str]:
        return [d.key for d in self.dimensions]

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """Ask `trial` for a value of every dimension, in the space's order."""
        return {d.key: d.suggest(trial) for d in self.dimensions}

    def train_options(self, params: dict[str, Any]) -> dict[str, Any]:
        """`TrainConfig` keyword arguments for a trial with `params` (fixed options first, then params)."""
        return nest_options({**self.fixed, **params})


def nest_options(flat: dict[str, Any]) -> dict[str, Any]:
    """Flat keys (`model_kwargs.channels`) as `TrainConfig` keyword arguments (`model_kwargs={...}`)."""
    out: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith(MODEL_KWARGS):
            kwargs[key[len(MODEL_KWARGS):]] = value
        else:
            out[key] = value
    if kwargs:
        out["model_kwargs"] = kwargs
    return out


def load_json_object(text: str | dict[str, Any], what: str) -> dict[str, Any]:
    """A JSON object given inline, as `@FILE`, or already parsed."""
    if isinstance(text, dict):
        return text
    source = text.strip()
    if source.startswith("@"):
        try:
            source = Path(source[1:]).read_text()
        except OSError as err:
            raise SearchSpaceInvalid(f"cannot read the {what} from {text[1:]}: {err.strerror}") from err
    try:
        value = json.loads(source)
    except json.JSONDecodeError as err:
        raise SearchSpaceInvalid(f"the {what} is not JSON: {err}") from err
    if not isinstance(value, dict):
        raise SearchSpaceInvalid(f"the {what} must be a JSON object of trainer options, got {type(value).__name__}")
    return value


def parse_space(space: str | dict[str, Any], fixed: str | dict[str, Any] | None = None) -> SearchSpace:
    """Check a space and its fixed options; every error names the key."""
    raw = load_json_object(space, "search space")
    fixed_flat = flatten_fixed(load_json_object(fixed or {}, "fixed options"))
    if not raw:
        raise SearchSpaceInvalid("the search space is empty: give at least one trainer option to search")
    dimensions = tuple(_dimension(key, spec) for key, spec in raw.items())
    for key in fixed_flat:
        _check_option(key, fixed=True)
        if key in raw:
            raise SearchSpaceInvalid(f"{key!r} is both searched and fixed: remove it from one of them")
    parsed = SearchSpace(dimensions=dimensions, fixed=fixed_flat)
    _check_values(parsed)
    _check_model_kwargs(parsed)
    return parsed


def flatten_fixed(fixed: dict[str, Any]) -> dict[str, Any]:
    """Fixed options with flat keys: a nested `model_kwargs` object as `model_kwargs.<argument>` keys."""
    flat = {k: v for k, v in fixed.items() if k != "model_kwargs"}
    nested = fixed.get("model_kwargs", {})
    if not isinstance(nested, dict):
        raise SearchSpaceInvalid(f"fixed option 'model_kwargs' must be a JSON object, got {nested!r}")
    flat.update({MODEL_KWARGS + k: v for k, v in nested.items()})
    return flat


def _check_option(key: str, *, fixed: bool = False) -> str:
    """The kind of value `key` takes, or SearchSpaceInvalid when it is no option a search may set."""
    if key.startswith(MODEL_KWARGS):
        name = key[len(MODEL_KWARGS):]
        if not name.isidentifier() or name in RESERVED_MODEL_ARGS:
            raise SearchSpaceInvalid(f"{key!r}: {name!r} is not a model argument a search may set")
        return "any"
    if key in TUNABLE:
        return TUNABLE[key]
    if fixed and key in FIXED_ONLY:
        return FIXED_ONLY[key]
    allowed = sorted(TUNABLE) + (sorted(FIXED_ONLY) if fixed else [])
    where = "fixed option" if fixed else "search space key"
    raise SearchSpaceInvalid(f"{where} {key!r} is not a trainer option a search may set; allowed: "
                             f"{', '.join(allowed)}, model_kwargs.<argument>")


def _number(key: str, field: str, value: Any, *, integer: bool) -> float | int:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not math.isfinite(value):
        kind = "an integer" if integer else "a finite number"
        raise SearchSpaceInvalid(f"search space key {key!r}: {field!r} must be {kind}, got {value!r}")
    return value


def _dimension(key: str, spec: Any) -> Dimension:
    kind = _check_option(key)
    if not isinstance(spec, dict):
        raise SearchSpaceInvalid(f"search space key {key!r}: expected an object like "
                                 f'{{"type": "float", "low": 0.01, "high": 0.1}}, got {spec!r}')
    dist = spec.get("type")
    if dist not in TYPES:
        raise SearchSpaceInvalid(f"search space key {key!r}: 'type' must be one of {', '.join(TYPES)}, got {dist!r}")
    unknown = sorted(set(spec) - FIELDS[dist])
    if unknown:
        raise SearchSpaceInvalid(f"search space key {key!r}: unknown field(s) {', '.join(unknown)} for type {dist!r} "
                                 f"(allowed: {', '.join(sorted(FIELDS[dist]))})")
    if dist == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise SearchSpaceInvalid(f"search space key {key!r}: 'choices' must be a non-empty list")
        for choice in choices:
            if choice is not None and not isinstance(choice, bool | int | float | str):
                raise SearchSpaceInvalid(f"search space key {key!r}: choice {choice!r} is not null, a boolean, "
                                         f"a number or a string")
        if len({json.dumps(c) for c in choices}) != len(choices):
            raise SearchSpaceInvalid(f"search space key {key!r}: 'choices' repeats a value")
        if kind == "str" and not all(isinstance(c, str) for c in choices):
            raise SearchSpaceInvalid(f"search space key {key!r}: choices must be strings")
        if kind == "int" and not all(isinstance(c, int) and not isinstance(c, bool) for c in choices):
            raise SearchSpaceInvalid(f"search space key {key!r}: choices must be integers")
        return Dimension(key=key, type=dist, choices=tuple(choices))
    if kind == "str":
        raise SearchSpaceInvalid(f"search space key {key!r} takes a name: use type 'categorical' with 'choices'")
    if kind == "int" and dist == "float":
        raise SearchSpaceInvalid(f"search space key {key!r} takes an integer: use type 'int' or 'categorical'")
    integer = dist == "int"
    for field in ("low", "high"):
        if field not in spec:
            raise SearchSpaceInvalid(f"search space key {key!r}: {field!r} is missing")
    low = _number(key, "low", spec["low"], integer=integer)
    high = _number(key, "high", spec["high"], integer=integer)
    if low > high:
        raise SearchSpaceInvalid(f"search space key {key!r}: low {low!r} is above high {high!r}")
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise SearchSpaceInvalid(f"search space key {key!r}: 'log' must be true or false, got {log!r}")
    step = spec.get("step")
    if step is not None:
        step = _number(key, "step", step, integer=integer)
        if step <= 0:
            raise SearchSpaceInvalid(f"search space key {key!r}: 'step' must be positive, got {step!r}")
        if log:
            raise SearchSpaceInvalid(f"search space key {key!r}: 'step' and 'log' cannot be used together")
    if log and low <= 0:
        raise SearchSpaceInvalid(f"search space key {key!r}: a log scale needs low > 0, got {low!r}")
    return Dimension(key=key, type=dist, low=low, high=high, log=log, step=step)


def _check_values(space: SearchSpace) -> None:
    """Build a `TrainConfig` with each end of each range (and each choice), the other options fixed."""
    from nightshift.train.config import TrainConfig

    def attempt(key: str, flat: dict[str, Any]) -> None:
        try:
            TrainConfig(data=Path("."), out=Path("."), checkpoint_dir=Path("."), **nest_options(flat))
        except UsageError as err:
            where = "fixed option" if key in space.fixed else "search space key"
            raise SearchSpaceInvalid(f"{where} {key!r}: {err}") from err
        except TypeError as err:  # e.g. a string where TrainConfig compares numbers
            where = "fixed option" if key in space.fixed else "search space key"
            raise SearchSpaceInvalid(f"{where} {key!r} has a value of the wrong type ({err})") from err

    for key, value in space.fixed.items():
        attempt(key, {key: value})
    for dim in space.dimensions:
        for value in dim.candidates():
            attempt(dim.key, {**space.fixed, dim.key: value})


def _check_model_kwargs(space: SearchSpace) -> None:
    """Every model a trial may build must exist and take every `model_kwargs.x`."""
    from nightshift.models import MODELS
    from nightshift.train.config import TrainConfig

    keys = [k for k in [*space.keys, *space.fixed] if k.startswith(MODEL_KWARGS)]
    model_dim = next((d for d in space.dimensions if d.key == "model"), None)
    models = list(model_dim.choices) if model_dim else [space.fixed.get("model", TrainConfig.model)]
    for model in models:
        try:
            factory = MODELS.get(str(model))
        except UsageError as err:
            raise SearchSpaceInvalid(f"'model': {err}") from err
        accepted = keyword_arguments(factory, supplied=RESERVED_MODEL_ARGS)
        if accepted is None:  # any argument, or no signature to read: the trial will tell
            continue
        for key in keys:
            if key[len(MODEL_KWARGS):] not in accepted:
                raise SearchSpaceInvalid(f"{key!r}: model {model!r} takes no argument "
                                         f"{key[len(MODEL_KWARGS):]!r}; its arguments: {', '.join(accepted)}")
