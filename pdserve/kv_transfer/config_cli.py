"""Parsing of the ``--kv-transfer-config`` command-line forms (JSON and dotted keys) into a
:class:`~pdserve.types.kv_transfer_config.KVTransferConfig`; runs before argparse sees the rest."""

from __future__ import annotations

import copy
import json
from typing import Any

from pdserve.types.kv_transfer_config import EXTRA_DEFAULTS, KVTransferConfig, KVTransferConfigError

CLI_FLAG = "--kv-transfer-config"


def _parse_value(text: str) -> Any:
    """A CLI value: JSON when it parses (``5``, ``true``, ``["UCX"]``), else the string itself."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text


def _set_dotted(target: dict[str, Any], path: list[str], value: Any, append: bool, flag: str) -> None:
    node = target
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise KVTransferConfigError(f"{flag}: {part!r} is not an object and has no sub-keys")
        node = child
    key = path[-1]
    if not append:
        node[key] = value
        return
    if key not in node:
        node[key] = (
            copy.deepcopy(EXTRA_DEFAULTS[key])
            if key in EXTRA_DEFAULTS and path[:-1] == ["kv_connector_extra_config"]
            else []
        )
    current = node[key]
    if not isinstance(current, list):
        raise KVTransferConfigError(f"{flag}: cannot append to {key!r}, it is not a list")
    current.extend(value if isinstance(value, list) else [value])


def extract_kv_transfer_args(argv: list[str]) -> tuple[KVTransferConfig | None, list[str]]:
    """Pull every ``--kv-transfer-config`` form out of ``argv`` (run before argparse).

    Accepted forms, applied in order of appearance (later ones override earlier ones)::

        --kv-transfer-config JSON          --kv-transfer-config=JSON
        --kv-transfer-config.KEY VALUE     --kv-transfer-config.KEY=VALUE
        --kv-transfer-config.A.B VALUE     (nested object keys)
        --kv-transfer-config.A.B+ VALUE    (append VALUE to a list; a JSON list is appended
                                            element by element)

    VALUE is parsed as JSON when it parses, else taken as a string. Scanning stops at ``--``.

    Args:
        argv: command-line arguments (without the program and subcommand names).

    Returns:
        ``(config, remaining_argv)``: ``config`` is None when no such flag appeared.

    Raises:
        KVTransferConfigError: a flag without a value, invalid JSON, or an invalid configuration.
    """
    data: dict[str, Any] = {}
    seen = False
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        if not (arg == CLI_FLAG or arg.startswith(CLI_FLAG + "=") or arg.startswith(CLI_FLAG + ".")):
            rest.append(arg)
            i += 1
            continue
        seen = True
        name, eq, inline = arg.partition("=")
        if eq:
            value_text = inline
            i += 1
        else:
            if i + 1 >= len(argv):
                raise KVTransferConfigError(f"{name} needs a value")
            value_text = argv[i + 1]
            i += 2
        if name == CLI_FLAG:
            try:
                obj = json.loads(value_text)
            except json.JSONDecodeError as e:
                raise KVTransferConfigError(
                    f"{CLI_FLAG} is not valid JSON ({e}): {value_text!r}"
                ) from None
            if not isinstance(obj, dict):
                raise KVTransferConfigError(
                    f"{CLI_FLAG} must be a JSON object, got {type(obj).__name__}"
                )
            _deep_merge(data, obj)
            continue
        dotted = name[len(CLI_FLAG) + 1 :]
        append = dotted.endswith("+")
        if append:
            dotted = dotted[:-1]
        path = dotted.split(".")
        if not all(path):
            raise KVTransferConfigError(f"malformed option {name!r}")
        _set_dotted(data, path, _parse_value(value_text), append, name)
    if not seen:
        return None, rest
    return KVTransferConfig.from_dict(data), rest


def _deep_merge(target: dict[str, Any], source: dict[str, Any]) -> None:
    for key, value in source.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _deep_merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
