"""Build the job config: base.yml < models/<model_name>.yml < user YAML < key=value < env.

Like MaxText: ``python -m dropless train [config.yml] key=value ...``. Later
sources override earlier ones; ``DROPLESS_<KEY>`` environment variables come
last. Every value remembers where it came from (``dropless config`` prints it).
Keys starting with ``xla_`` are XLA flags and ALL-CAPS keys are environment
variables: they go to ``Config.xla_flags`` / ``Config.env``.

Bad input raises ``ConfigError`` with one line naming the key, the bad value,
its source and what is allowed (with a did-you-mean for misspelled keys).
"""

import difflib
import os
import re
from pathlib import Path
from typing import Any

import pydantic
import yaml

from dropless.config.schema import Config, ContradictionError

CONFIG_DIR = Path(__file__).parent
ENV_PREFIX = "DROPLESS_"
_ENV_KEY = re.compile(r"^[A-Z][A-Z0-9_]*$")
# DROPLESS_ variables that are not config keys: test and benchmark switches
# (tests' slow set, CPU device count, the commit a GPU copy without .git records).
NON_CONFIG_ENV = ("DROPLESS_SLOW", "DROPLESS_CPU_DEVICES", "DROPLESS_COMMIT")


class ConfigError(ValueError):
    """A config problem, stated in one line for the user."""


class ResolvedConfig:
    """The validated ``Config`` plus the source of each value."""

    def __init__(self, config: Config, sources: dict[str, str]):
        self.config = config
        self.sources = sources

    def source(self, key: str) -> str:
        return self.sources.get(key, "default")


def available_models() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.yml"))


def _read_yaml(path: Path, label: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        hint = "" if path.suffix in (".yml", ".yaml") else f" (a config key is key=value, e.g. {label}=...)"
        raise ConfigError(f"config file {label} not found{hint}") from None
    except OSError as e:
        raise ConfigError(f"config file {label} cannot be read: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {label}{where} is not valid YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {label} must be a mapping of key: value, got {type(data).__name__}")
    return data


def _parse_value(text: str) -> Any:
    """Command-line / env value: YAML scalar syntax (8, true, 1e-4, [1, 2], 'x')."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def parse_overrides(args: list[str]) -> dict[str, Any]:
    out = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"argument {arg!r} is not key=value (e.g. steps=10)")
        out[key.strip()] = _parse_value(value)
    return out


def _env_overrides(environ) -> dict[str, Any]:
    fields = {k.upper(): k for k in Config.model_fields}
    out = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in NON_CONFIG_ENV:
            continue
        short = name[len(ENV_PREFIX):]
        key = fields.get(short)
        if key is None:
            near = difflib.get_close_matches(short, fields, n=1)
            hint = f"; did you mean {ENV_PREFIX}{near[0]}?" if near else ""
            raise ConfigError(f"environment variable {name} names no config key{hint}")
        out[key] = _parse_value(value)
    return out


def _split_special(layer: dict[str, Any]) -> tuple[dict, dict, dict]:
    """Separate XLA flags (xla_*) and env vars (ALL-CAPS) from plain keys."""
    plain, flags, env = {}, {}, {}
    for k, v in layer.items():
        k = str(k)
        if k.startswith("xla_") and k != "xla_flags":
            flags[k] = v
        elif _ENV_KEY.match(k):
            env[k] = "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
        else:
            plain[k] = v
    return plain, flags, env


def _check_keys(layer: dict[str, Any], label: str):
    for key in layer:
        if key not in Config.model_fields:
            near = difflib.get_close_matches(key, Config.model_fields, n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else "; run 'dropless config --keys' to list the keys"
            raise ConfigError(f"unknown key '{key}' (from {label}){hint}")


def load_config(config_file: str | None = None, overrides: list[str] | dict | None = None,
                environ=None) -> ResolvedConfig:
    """Resolve and validate the job config. Raises ConfigError on bad input."""
    environ = os.environ if environ is None else environ
    cli = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides or {})
    layers: list[tuple[str, dict]] = [("base.yml", _read_yaml(CONFIG_DIR / "base.yml", "base.yml"))]
    user = _read_yaml(Path(config_file), config_file) if config_file else {}
    env_layer = _env_overrides(environ)

    model_name = layers[0][1].get("model_name", Config.model_fields["model_name"].default)
    for layer in (user, cli, env_layer):
        model_name = layer.get("model_name", model_name)
    path = CONFIG_DIR / "models" / f"{model_name}.yml"
    if not path.exists():
        names = available_models()
        near = difflib.get_close_matches(str(model_name), names, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise ConfigError(f"model_name={model_name!r}: no such model (allowed: {', '.join(names)}){hint}")
    layers.append((f"models/{model_name}.yml", _read_yaml(path, path.name)))
    if config_file:
        layers.append((config_file, user))
    layers.append(("command line", cli))
    layers.append(("environment", env_layer))

    values, sources, flags, env = {}, {}, {}, {}
    for label, layer in layers:
        plain, layer_flags, layer_env = _split_special(layer)
        _check_keys(plain, label)
        for k, v in plain.items():
            if k in ("xla_flags", "env") and isinstance(v, dict):
                (flags if k == "xla_flags" else env).update(v)
            else:
                values[k] = v
            sources[k] = label
        for k in layer_flags:
            sources[k] = label
        for k in layer_env:
            sources[k] = label
        flags.update(layer_flags)
        env.update(layer_env)
    if values.get("hf_model_path"):
        _apply_hf_config(values, sources, {config_file, "command line", "environment"})
    values["xla_flags"] = flags
    values["env"] = {k: str(v) for k, v in env.items()}
    return ResolvedConfig(_validate(values, sources), sources)


def _apply_hf_config(values: dict, sources: dict, explicit: set) -> None:
    """Model keys from hf_model_path's config.json (``hf_config``)."""
    from dropless.config import hf_config

    try:
        hf_config.apply_hf_config(values, sources, explicit)
    except hf_config.HFConfigError as e:
        raise ConfigError(str(e)) from None


def _validate(values: dict, sources: dict) -> Config:
    try:
        return Config(**values)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "value_error" and isinstance(err.get("ctx", {}).get("error"), ContradictionError):
            c = err["ctx"]["error"]
            raise ConfigError(
                f"{c.key}={c.value!r} (from {sources.get(c.key, 'default')}): {c}") from None
        key = str(err["loc"][0]) if err["loc"] else "?"
        value = values.get(key, "<missing>")
        # A union (say Literal["auto"] | bool) fails once per member: name them all.
        same = [x for x in e.errors() if x["loc"][:1] == err["loc"][:1]]
        raise ConfigError(
            f"{key}={value!r} (from {sources.get(key, 'default')}): {_allowed(same)}") from None


def _allowed(errs: list[dict]) -> str:
    """One phrase for a key's validation errors: what is allowed."""
    if len(errs) > 1 and all(x["type"] == "literal_error" or x["type"].startswith("bool") for x in errs):
        literals = [x["ctx"]["expected"] for x in errs if x["type"] == "literal_error"]
        return f"must be one of {', '.join(literals)}, true or false"
    err = errs[0]
    ctx = err.get("ctx", {})
    if err["type"] == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    return err["msg"][0].lower() + err["msg"][1:]
