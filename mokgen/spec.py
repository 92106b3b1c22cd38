"""MoE layer specs: frozen pydantic models and YAML loading.

A spec is a model family's published MoE-layer shapes and routing rules plus a default target. It
is the first stage of the pipeline and stays pure: no torch, no nvcc, no Jinja.

Every failure a user can cause raises :class:`mokgen.errors.SpecError` with one line of the form::

    <source>: <field.path>: <rule>[, got <value>][ (and N more)]

where ``<source>`` is the YAML file (or ``spec '<name>'`` for in-memory changes such as
:meth:`MoESpec.with_target`). File-level problems (missing file, malformed YAML, top level not a
mapping) use ``<file>: <problem>``; an unknown spec name lists the bundled names and aliases.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from mokgen.errors import SpecError
from mokgen.paths import specs_dir

__all__ = [
    "NAME_PATTERN",
    "TILE_ALIGN",
    "SharedExperts",
    "Activation",
    "Routing",
    "Target",
    "MoESpec",
    "spec_from_dict",
    "load_spec",
    "resolve_spec",
    "bundled_specs",
    "bundled_aliases",
]

#: Spec names and aliases reach generated code, symbol names and file names.
NAME_PATTERN = r"^[a-z0-9][a-z0-9.\-]{0,62}$"
#: hidden_size and every intermediate size must be a multiple of this (the kernels' tile alignment).
TILE_ALIGN = 128
#: hidden_size and every intermediate size are at most this (over 4x the widest bundled one, 7168): a
#: bound that stops a mistyped size before it plans terabytes of weights
MAX_WIDTH = 32768
MAX_EXPERTS = 1024
MAX_TOP_K = 32
MAX_TOKENS_PER_RANK = 1_048_576

# Strict scalars: a spec never silently turns "8", 8.0 or true into an int, nor 1 into a string.
_Int = Annotated[int, Field(strict=True)]
_NonNegInt = Annotated[int, Field(strict=True, ge=0)]
_PosInt = Annotated[int, Field(strict=True, ge=1)]
_Bool = Annotated[bool, Field(strict=True)]
_PosFloat = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
_Name = Annotated[str, Field(strict=True, pattern=NAME_PATTERN)]


def _rule(field: str, rule: str) -> PydanticCustomError:
    """A cross-field violation; ``field`` is relative to the model that raises it."""
    return PydanticCustomError("spec_rule", "{rule}", {"field": field, "rule": rule})


def _tile_rule(value: int) -> str | None:
    if value <= 0 or value % TILE_ALIGN:
        return (
            f"must be a positive multiple of {TILE_ALIGN} (the kernels' tile alignment), "
            f"got {value}"
        )
    if value > MAX_WIDTH:
        return f"must be at most {MAX_WIDTH}, got {value}"
    return None


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SharedExperts(_Frozen):
    """Always-active experts computed locally for every token (no transfer)."""

    count: _NonNegInt = 0
    intermediate_size: _NonNegInt = 0
    #: "sigmoid": the shared expert's output is scaled by sigmoid(x @ w_shared_gate) (Qwen3-Next/3.5)
    gate: Literal["none", "sigmoid"] = "none"

    @model_validator(mode="after")
    def _consistent(self) -> "SharedExperts":
        if self.count > 0:
            problem = _tile_rule(self.intermediate_size)
            if problem:
                raise _rule("intermediate_size", f"{problem} (count is {self.count})")
        else:
            if self.gate != "none":
                raise _rule("gate", f"must be 'none' when count is 0, got {self.gate!r}")
            if self.intermediate_size != 0:
                raise _rule(
                    "intermediate_size",
                    f"must be 0 when count is 0, got {self.intermediate_size}",
                )
        return self


class Activation(_Frozen):
    """Expert activation: down(act(gate(x)) * up(x))."""

    kind: Literal["swiglu"] = "swiglu"
    #: when set, gate is clamped to <= limit and up to [-limit, limit] before the product
    clamp_limit: Optional[_PosFloat] = None


class Routing(_Frozen):
    """How router logits become top-k expert ids and combine weights."""

    scoring: Literal["softmax", "sigmoid", "sqrtsoftplus"]
    #: a per-expert bias added to the scores for selection only (DeepSeek-V3 "noaux_tc")
    score_correction_bias: _Bool = False
    #: divide the selected k weights by their sum (HF ``norm_topk_prob``)
    renormalize: _Bool = True
    routed_scaling_factor: _PosFloat = 1.0
    n_group: _PosInt = 1
    topk_group: _PosInt = 1
    #: how a group is scored for group-limited top-k (DeepSeek-V3: sum of the top-2 biased scores)
    group_score: Literal["top2_sum", "max"] = "top2_sum"

    @model_validator(mode="after")
    def _consistent(self) -> "Routing":
        if self.topk_group > self.n_group:
            raise _rule(
                "topk_group",
                f"must be between 1 and n_group ({self.n_group}), got {self.topk_group}",
            )
        return self


class Target(_Frozen):
    """What a build is specialized for; the bundled YAML holds the default target."""

    arch: Literal["sm_90a"] = "sm_90a"
    numerics: Literal["bf16", "mxfp8"] = "bf16"
    max_ep_ranks: _PosInt = 1
    max_tokens_per_rank: Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS_PER_RANK)] = 16384


class MoESpec(_Frozen):
    """One MoE layer: shapes, routing rules and default target."""

    name: _Name
    aliases: tuple[_Name, ...] = ()
    description: Annotated[str, Field(strict=True)] = ""
    hidden_size: _Int
    moe_intermediate_size: _Int
    num_experts: Annotated[int, Field(strict=True, ge=1, le=MAX_EXPERTS)]
    top_k: Annotated[int, Field(strict=True, ge=1, le=MAX_TOP_K)]
    shared_experts: SharedExperts = SharedExperts()
    activation: Activation = Activation()
    routing: Routing
    target: Target = Target()

    @model_validator(mode="after")
    def _consistent(self) -> "MoESpec":
        for field in ("hidden_size", "moe_intermediate_size"):
            problem = _tile_rule(getattr(self, field))
            if problem:
                raise _rule(field, problem)

        e, k = self.num_experts, self.top_k
        if k > e:
            raise _rule("top_k", f"must be between 1 and num_experts ({e}), got {k}")

        r = self.routing
        if e % r.n_group:
            raise _rule("routing.n_group", f"must divide num_experts ({e}), got {r.n_group}")
        per_group = e // r.n_group
        if k > r.topk_group * per_group:
            raise _rule(
                "top_k",
                f"must be at most routing.topk_group * (num_experts // routing.n_group) "
                f"= {r.topk_group} * {per_group} = {r.topk_group * per_group}, got {k}",
            )
        if r.n_group > 1 and r.group_score == "top2_sum" and per_group < 2:
            raise _rule(
                "routing.group_score",
                f"'top2_sum' needs at least 2 experts per group, got {per_group} "
                f"(num_experts {e} / n_group {r.n_group})",
            )

        ep = self.target.max_ep_ranks
        if ep > e or e % ep:
            raise _rule(
                "target.max_ep_ranks",
                f"must divide num_experts ({e}) and be at most num_experts, got {ep}",
            )

        seen = {self.name}
        for i, alias in enumerate(self.aliases):
            if alias in seen:
                what = "the name" if alias == self.name else "another alias"
                raise _rule(f"aliases.{i}", f"must not repeat {what}, got {alias!r}")
            seen.add(alias)
        return self

    # ------------------------------------------------------------------ helpers
    def with_target(self, **changes: Any) -> "MoESpec":
        """A copy with target fields replaced, validated again (raises :class:`SpecError`)."""
        data = self.model_dump()
        data["target"].update(changes)
        return spec_from_dict(data, source=f"spec {self.name!r}")

    def canonical_dict(self) -> dict:
        """JSON-ready dict of every field (tuples become lists); stable for hashing."""
        return self.model_dump(mode="json")

    def experts_per_rank(self, ep: int) -> int:
        """Routed experts held by each of ``ep`` expert-parallel ranks."""
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise SpecError(f"spec {self.name!r}: ep: must be a positive integer, got {ep!r}")
        if self.num_experts % ep:
            raise SpecError(
                f"spec {self.name!r}: ep: must divide num_experts ({self.num_experts}), got {ep}"
            )
        return self.num_experts // ep


# ---------------------------------------------------------------------- error formatting
def _path(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _allowed_fields(loc: tuple) -> list[str]:
    """Field names of the model that holds ``loc`` (for 'unknown field' hints)."""
    model: type[BaseModel] = MoESpec
    for part in loc[:-1]:
        info = model.model_fields.get(part) if isinstance(part, str) else None
        sub = getattr(info, "annotation", None) if info else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return []
        model = sub
    return list(model.model_fields)


def _describe(err: Mapping[str, Any]) -> str:
    kind = err["type"]
    loc = tuple(err.get("loc", ()))
    if kind == "spec_rule":
        ctx = err.get("ctx", {})
        return f"{_path(loc + (ctx['field'],))}: {ctx['rule']}"
    where = _path(loc) or "(top level)"
    if kind == "extra_forbidden":
        allowed = _allowed_fields(loc)
        hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        if allowed:
            extra += f"; allowed: {', '.join(allowed)}"
        return f"{where}: unknown field{extra}"
    if kind == "missing":
        return f"{where}: missing required field"
    if kind == "invalid_key":
        return f"{where}: field names must be strings, got {_short(err.get('input'))}"
    msg = str(err.get("msg", kind))
    msg = msg.replace("Input should be", "must be", 1).replace("String should", "must", 1)
    return f"{where}: {msg}, got {_short(err.get('input'))}"


def _format_validation_error(source: str, exc: ValidationError) -> str:
    # An unknown field usually explains a "missing" one next to it (a typo): report it first.
    errors = sorted(exc.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    text = f"{source}: {_describe(errors[0])}" if errors else f"{source}: invalid spec"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more)"
    return text


def spec_from_dict(data: Any, source: str = "<dict>") -> MoESpec:
    """Validate a parsed spec; any problem raises :class:`SpecError` naming ``source``."""
    if not isinstance(data, Mapping):
        got = "nothing (empty document)" if data is None else type(data).__name__
        raise SpecError(f"{source}: top level must be a mapping of spec fields, got {got}")
    try:
        return MoESpec.model_validate(dict(data))
    except ValidationError as exc:
        raise SpecError(_format_validation_error(source, exc)) from None


# ---------------------------------------------------------------------- YAML and lookup
def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    detail = f"{problem} ({context})" if context else problem
    return f"malformed YAML{where}: {detail}"


def _duplicate_key(node: yaml.Node | None) -> str | None:
    """A mapping key that appears twice (yaml.safe_load would silently keep the last one)."""
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    m = key.start_mark
                    return f"duplicate key {key.value!r} at line {m.line + 1}, column {m.column + 1}"
                seen.add(key.value)
            found = _duplicate_key(value)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            found = _duplicate_key(item)
            if found:
                return found
    return None


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: spec file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read spec file: {exc}") from None
    try:
        data = yaml.safe_load(text)
        duplicate = _duplicate_key(yaml.compose(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: {_yaml_problem(exc)}") from None
    if duplicate:
        raise SpecError(f"{path}: malformed spec: {duplicate}")
    return data


def bundled_specs() -> dict[str, Path]:
    """Canonical name -> YAML file of every spec under model_specs/, sorted by name."""
    return {p.stem: p for p in sorted(specs_dir().glob("*.yaml"), key=lambda p: p.stem)}


_alias_cache: dict[tuple, dict[str, str]] = {}


def bundled_aliases() -> dict[str, str]:
    """Alias -> canonical name for the bundled specs (sorted by alias)."""
    files = bundled_specs()
    key = tuple((name, p.stat().st_mtime_ns) for name, p in files.items())
    cached = _alias_cache.get(key)
    if cached is not None:
        return dict(cached)
    aliases: dict[str, str] = {}
    for name, path in files.items():
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # a broken file reports itself when loaded by its own name
        raw = data.get("aliases", ()) if isinstance(data, Mapping) else ()
        for alias in raw if isinstance(raw, (list, tuple)) else ():
            if not isinstance(alias, str):
                continue
            owner = name if alias in files else aliases.get(alias)
            if owner is not None and owner != name:
                raise SpecError(
                    f"{path}: aliases: {alias!r} is already used by bundled spec {owner!r}"
                )
            if alias not in files:
                aliases[alias] = name
    result = dict(sorted(aliases.items()))
    _alias_cache.clear()
    _alias_cache[key] = result
    return dict(result)


def _looks_like_path(ref: str) -> bool:
    return (
        os.sep in ref
        or "/" in ref
        or (os.altsep is not None and os.altsep in ref)
        or ref.endswith((".yaml", ".yml"))
    )


def _unknown_name(ref: str) -> SpecError:
    names = list(bundled_specs())
    aliases = bundled_aliases()
    hint = difflib.get_close_matches(ref, names + list(aliases), n=1)
    did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
    alias_text = ", ".join(f"{a} -> {n}" for a, n in aliases.items()) or "none"
    return SpecError(
        f"unknown spec {ref!r}{did_you_mean}: bundled specs are {', '.join(names) or 'none'}; "
        f"aliases: {alias_text}; or pass a path to a YAML file"
    )


def resolve_spec(ref: str | os.PathLike) -> Path:
    """The YAML file for ``ref``: a path, or a bundled name or alias (case-sensitive)."""
    if isinstance(ref, os.PathLike):
        path = Path(ref)
    elif isinstance(ref, str):
        if not ref.strip():
            raise _unknown_name(ref)
        if _looks_like_path(ref):
            path = Path(ref).expanduser()
        else:
            files = bundled_specs()
            if ref in files:
                return files[ref]
            canonical = bundled_aliases().get(ref)
            if canonical is not None:
                return files[canonical]
            if Path(ref).is_file():
                return Path(ref)
            raise _unknown_name(ref)
    else:
        raise SpecError(f"spec reference must be a name or a path, got {type(ref).__name__}")
    if not path.exists():
        stem = path.stem if path.suffix in (".yaml", ".yml") else None
        hint = ""
        if stem and (stem in bundled_specs() or stem in bundled_aliases()):  # `kimi-k2.5.yaml` from another dir
            hint = f" (the bundled spec is named without a path or suffix: {stem!r})"
        raise SpecError(f"{path}: spec file not found{hint}")
    if not path.is_file():
        raise SpecError(f"{path}: spec path is not a file")
    return path


def _is_bundled(path: Path) -> bool:
    try:
        return path.resolve().parent == specs_dir().resolve()
    except OSError:
        return False


def load_spec(ref: str | os.PathLike) -> MoESpec:
    """Load and validate a spec by path, bundled name or alias; errors raise :class:`SpecError`."""
    path = resolve_spec(ref)
    spec = spec_from_dict(_read_yaml(path), source=str(path))
    if _is_bundled(path) and spec.name != path.stem:
        raise SpecError(
            f"{path}: name: must equal the file stem {path.stem!r} for bundled specs, "
            f"got {spec.name!r}"
        )
    return spec
