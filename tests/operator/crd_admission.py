"""What the API server does with a RolloutMatchingJob at admission, offline: structural
defaulting, unknown-field rejection (kubectl's default Strict field validation), the OpenAPI
schema (jsonschema, draft 4 semantics like Kubernetes) and every CEL rule of the CRD evaluated
with cel-python, including transition rules against the old object."""

from __future__ import annotations

from typing import Any

import celpy
import jsonschema
from rmsft_operator.crd import apply_defaults, build_crd


def root_schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _path(parts: list[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _unknown(schema: dict[str, Any], obj: Any, where: str) -> list[str]:
    if isinstance(obj, list) and "items" in schema:
        return [e for i, v in enumerate(obj) for e in _unknown(schema["items"], v, f"{where}[{i}]")]
    if not isinstance(obj, dict) or schema.get("type") != "object":
        return []
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    props = schema.get("properties")
    if props is None:
        extra = schema.get("additionalProperties")
        return [e for k, v in obj.items() for e in _unknown(extra or {}, v, f"{where}.{k}")]
    errs = []
    for key, value in obj.items():
        if key not in props:
            errs.append(f'{where}.{key}: unknown field "{where}.{key}"')
        else:
            errs += _unknown(props[key], value, f"{where}.{key}")
    return errs


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _eval(rule: str, activation: dict[str, Any]) -> bool:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    result = _PROGRAMS[rule].evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})
    if isinstance(result, Exception):
        raise result
    return bool(result)


def _failed_rules(schema: dict[str, Any], obj: Any, old: Any, where: str) -> list[tuple[str, dict[str, str]]]:
    """(schema path, rule) of every CEL rule that `obj` fails, walking the schema as the API server does."""
    failed = []
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue  # transition rules only run on updates where the old value exists
        activation = {"self": obj, **({"oldSelf": old} if transition else {})}
        if not _eval(rule["rule"], activation):
            failed.append((where, rule))
    if isinstance(obj, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj:
                old_sub = old.get(key) if isinstance(old, dict) else None
                failed += _failed_rules(sub, obj[key], old_sub, f"{where}.{key}" if where else key)
    return failed


def _cel(schema: dict[str, Any], obj: Any, old: Any, where: str) -> list[str]:
    return [
        f"{path or '<root>'}: Invalid value: {rule['message']}" for path, rule in _failed_rules(schema, obj, old, where)
    ]


def _typed(schema: dict[str, Any], obj: Any) -> Any:
    """Values as the API server hands them to CEL: a `type: number` field is a double even when written as an
    integer (`kl_coef: 1`), so a rule comparing it with `0.0` has an overload (cel-python, like CEL itself,
    has no int/double comparison)."""
    if schema.get("type") == "number" and isinstance(obj, int) and not isinstance(obj, bool):
        return float(obj)
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [_typed(schema["items"], v) for v in obj]
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        return {k: _typed(props[k], v) if k in props else v for k, v in obj.items()}
    return obj


def admit(doc: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Rejection messages for `doc` (empty list = admitted), as `kubectl apply` would show them."""
    schema = root_schema()
    errs = _unknown(schema["properties"]["spec"], doc.get("spec") or {}, "spec")
    if errs:
        return errs
    obj = apply_defaults(schema, doc)
    old_obj = apply_defaults(schema, old) if old is not None else None
    validator = jsonschema.Draft4Validator(schema)
    errs = [f"{_path(list(e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]
    if errs:
        return errs
    return _cel(schema, _typed(schema, obj), _typed(schema, old_obj) if old_obj is not None else None, "")


def failed_rules(doc: dict[str, Any], old: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(schema path, rule text) of every CEL rule `doc` fails at admission (after the schema's own checks pass;
    an empty list when the schema already refuses it, as the API server would not reach the rules)."""
    schema = root_schema()
    obj = apply_defaults(schema, doc)
    old_obj = apply_defaults(schema, old) if old is not None else None
    if _unknown(schema["properties"]["spec"], doc.get("spec") or {}, "spec") or list(
        jsonschema.Draft4Validator(schema).iter_errors(obj)
    ):
        return []
    typed_old = _typed(schema, old_obj) if old_obj is not None else None
    return [(path, rule["rule"]) for path, rule in _failed_rules(schema, _typed(schema, obj), typed_old, "")]


def every_rule(schema: dict[str, Any] | None = None, where: str = "") -> list[tuple[str, str, str]]:
    """(schema path, rule text, message) of every CEL rule in the CRD's schema."""
    schema = root_schema() if schema is None else schema
    rules = [(where, r["rule"], r["message"]) for r in schema.get("x-kubernetes-validations", [])]
    for key, sub in (schema.get("properties") or {}).items():
        rules += every_rule(sub, f"{where}.{key}" if where else key)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            rules += every_rule(schema[key], f"{where}[]")
    return rules


def default_errors(schema: dict[str, Any], where: str = "") -> list[str]:
    """What the API server says about the CRD's own `default`s when the CRD is created: every
    default is validated against its schema node and that node's CEL rules *as written*, without
    its nested defaults filled in (a section's `default: {}` reads no defaulted keys)."""
    errs: list[str] = []
    if "default" in schema:
        value = schema["default"]
        errs += [f"{where}.default: {e.message}" for e in jsonschema.Draft4Validator(schema).iter_errors(value)]
        try:
            errs += [f"{where}.default: {e}" for e in _cel(schema, value, None, where)]
        except Exception as exc:  # cel-python raises its own types for missing keys
            errs.append(f"{where}.default: {type(exc).__name__}: {exc} evaluating a rule")
    for key, sub in (schema.get("properties") or {}).items():
        errs += default_errors(sub, f"{where}.{key}" if where else key)
    if isinstance(schema.get("items"), dict):
        errs += default_errors(schema["items"], f"{where}[]")
    return errs
