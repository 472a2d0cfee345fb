"""Protocol fidelity against SGLang's own source: the pinned release's wheel (downloaded without
dependencies, never imported) is read with `ast`; every route the client calls and `megapkl serve`
answers must exist in SGLang's HTTP server with that method, and every request field either of
them uses must be a field of the request class SGLang binds to that route. Nothing is hand-copied
from SGLang: routes, their request classes and the classes' fields all come from the wheel.

The sources are read from the installed sglang (the test environment has the pinned one); without
it, from the wheel cached under .cache/sglang-wheel/. Without either and without network the test
skips, except under CI=true where a failed download is a failure.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "sglang-wheel"
SOURCES = {"io_struct": "sglang/srt/managers/io_struct.py",
           "http_server": "sglang/srt/entrypoints/http_server.py",
           "api_types": "sglang/api/v1/api_types.py"}


def pinned_sglang_version() -> str:
    """The `sglang==X` pin of pyproject's `gpu` extra (the version the project supports)."""
    text = (REPO / "pyproject.toml").read_text()
    line = next((l for l in text.splitlines() if l.strip().startswith("gpu")), "")
    match = re.search(r'"sglang==([0-9][^"]*)"', line)
    assert match, "pyproject.toml: the gpu extra must pin sglang==<version>"
    return match.group(1)


def _download(version: str) -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
    if wheels:
        return wheels[0]
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            f"sglang=={version}", "-d", str(CACHE), "--quiet", "--disable-pip-version-check"]
    # The wheel is CPython-specific; any platform's copy holds the same Python sources.
    attempts = [base, base + ["--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"]]
    errors = []
    for cmd in attempts:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
        if wheels:
            return wheels[0]
        errors.append(proc.stderr.strip()[-500:])
    raise RuntimeError(f"pip download --no-deps sglang=={version} failed: {errors}")


def _installed(version: str):
    """The installed sglang's package directory when it is the pinned version (the test
    environment installs it: tools/setup_env.sh test), else None."""
    import importlib.metadata
    import importlib.util

    try:
        if importlib.metadata.version("sglang") != version:
            return None
        spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    return Path(spec.origin).parent.parent if spec and spec.origin else None


@pytest.fixture(scope="session")
def sglang_source() -> dict[str, ast.Module]:
    version = pinned_sglang_version()
    site = _installed(version)
    if site is not None:
        return {key: ast.parse((site / path).read_text("utf-8"), filename=path)
                for key, path in SOURCES.items()}
    try:
        wheel = _download(version)
    except Exception as exc:  # no network, no registry
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot download the pinned SGLang wheel under CI: {exc}")
        pytest.skip(f"cannot download the pinned SGLang wheel: {exc}")
    with zipfile.ZipFile(wheel) as zf:
        return {key: ast.parse(zf.read(path).decode("utf-8"), filename=path)
                for key, path in SOURCES.items()}


# ---------------------------------------------------------------- reading SGLang's source


def class_fields(module: ast.Module) -> dict[str, set[str]]:
    """Annotated fields of every class, including those inherited from classes of the module."""
    classes = {n.name: n for n in module.body if isinstance(n, ast.ClassDef)}

    def fields(name: str, seen: frozenset = frozenset()) -> set[str]:
        node = classes[name]
        out = {s.target.id for s in node.body
               if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
               and "ClassVar" not in ast.unparse(s.annotation)}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes and base.id not in seen:
                out |= fields(base.id, seen | {name})
        return out

    return {name: fields(name) for name in classes}


@dataclass
class Route:
    methods: set[str]
    body_class: str | None


def _body_class(func: ast.AST) -> str | None:
    """The request class of a route handler: `obj: X` or `obj: Annotated[X, Body()]`."""
    for arg in func.args.args:
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Annotated":
            elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            ann = elts[0]
        if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Optional":
            ann = ann.slice
        if isinstance(ann, ast.Name) and ann.id.endswith(("ReqInput", "Req")):
            return ann.id
    return None


def http_routes(module: ast.Module) -> dict[str, Route]:
    """path -> methods and request class, from the `@app.get/post/api_route` decorators."""
    routes: dict[str, Route] = {}
    for node in ast.walk(module):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and ast.unparse(dec.func.value) == "app" and dec.args
                    and isinstance(dec.args[0], ast.Constant)):
                continue
            kind = dec.func.attr
            if kind == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                methods = ({e.value for e in kw["methods"].elts} if "methods" in kw else {"GET"})
            elif kind in ("get", "post", "put", "delete"):
                methods = {kind.upper()}
            else:
                continue
            route = routes.setdefault(dec.args[0].value, Route(set(), None))
            route.methods |= methods
            route.body_class = route.body_class or _body_class(node)
    return routes


# ---------------------------------------------------------------- the checks


def _check(routes: dict[str, Route], fields: dict[str, set[str]], uses: dict[str, tuple],
           who: str) -> list[str]:
    """Problems of `uses` {path: (method, fields)} against SGLang's routes and classes."""
    problems = []
    for path, (method, used) in uses.items():
        route = routes.get(path)
        if route is None:
            problems.append(f"{who}: route {path} does not exist in SGLang's http_server.py")
            continue
        if method not in route.methods:
            problems.append(f"{who}: {method} {path}, SGLang serves {sorted(route.methods)}")
        if used and route.body_class is None:
            problems.append(f"{who}: {path} takes no request class in SGLang, yet sends {used}")
            continue
        unknown = set(used) - fields.get(route.body_class, set())
        if unknown:
            problems.append(f"{who}: {path} fields {sorted(unknown)} are not fields of SGLang's "
                            f"{route.body_class}")
    return problems


def test_parser_reads_known_facts(sglang_source):
    """The readers find what they must, so an empty result cannot pass the other tests."""
    routes = http_routes(sglang_source["http_server"])
    fields = class_fields(sglang_source["io_struct"])
    assert routes["/generate"].body_class == "GenerateReqInput"
    assert {"POST", "PUT"} <= routes["/generate"].methods
    assert routes["/update_weights_from_disk"].body_class == "UpdateWeightFromDiskReqInput"
    assert "rid" in fields["UpdateWeightFromDiskReqInput"]  # inherited from BaseReq
    assert {"input_ids", "return_routed_experts"} <= fields["GenerateReqInput"]
    assert "max_new_tokens" in class_fields(sglang_source["api_types"])["SamplingParams"]
    problems = _check(routes, fields, {"/no_such_route": ("GET", ()),
                                       "/generate": ("POST", ("no_such_field",))}, "probe")
    assert len(problems) == 2, problems


def test_client_routes_and_fields_exist_in_sglang(sglang_source):
    from megapkl.rollout.sglang import protocol

    routes = http_routes(sglang_source["http_server"])
    fields = class_fields(sglang_source["io_struct"])
    uses = {path: (method, tuple(protocol.REQUEST_FIELDS.get(name, ())))
            for name, (method, path) in protocol.ROUTES.items()}
    assert uses, "the client declares no routes"
    assert _check(routes, fields, uses, "client") == []
    sampling = class_fields(sglang_source["api_types"])["SamplingParams"]
    assert set(protocol.SAMPLING_FIELDS) - sampling == set()


def test_serve_routes_and_fields_exist_in_sglang(sglang_source):
    from megapkl.serve import serve_protocol as serve

    routes = http_routes(sglang_source["http_server"])
    fields = class_fields(sglang_source["io_struct"])
    uses = {path: ("POST", tuple(f)) for path, f in serve.ROUTE_FIELDS.items()}
    uses.update({path: ("GET", ()) for path in serve.GET_ROUTES})
    assert _check(routes, fields, uses, "megapkl serve") == []
    refused = set(serve.UNSUPPORTED_GENERATE_FIELDS) - fields["GenerateReqInput"]
    assert refused == set(), f"refused /generate fields that SGLang does not have: {refused}"
    sampling = class_fields(sglang_source["api_types"])["SamplingParams"]
    assert set(serve.SAMPLING_FIELDS) - sampling == set()


def test_serve_answers_every_client_route():
    """Every (method, path) the client calls is served by `megapkl serve` (no wheel needed)."""
    from megapkl.serve import serve_protocol as serve
    from megapkl.rollout.sglang import protocol

    served = {("POST", p) for p in serve.ROUTE_FIELDS} | {("GET", p) for p in serve.GET_ROUTES}
    served |= {("POST", "/flush_cache")}
    missing = {mp for mp in protocol.ROUTES.values() if mp not in served}
    assert missing == set()
    for name, used in protocol.REQUEST_FIELDS.items():
        path = protocol.ROUTES[name][1]
        assert set(used) <= set(serve.ROUTE_FIELDS.get(path, ())), (name, used)
    assert set(protocol.SAMPLING_FIELDS) <= set(serve.SAMPLING_FIELDS)


def _sglang_model_info_keys(module: ast.Module) -> set[str]:
    """Keys of the `result = {...}` literal of SGLang's /model_info handler."""
    func = next(n for n in ast.walk(module) if isinstance(n, ast.AsyncFunctionDef)
                and n.name == "model_info")
    literal = next(n.value for n in ast.walk(func) if isinstance(n, ast.Assign)
                   and isinstance(n.value, ast.Dict))
    return {k.value for k in literal.keys if isinstance(k, ast.Constant)}


def test_serve_model_info_has_sglang_keys(sglang_source):
    """`/model_info` (what sglang-router reads to register a worker) answers SGLang's keys."""
    from types import SimpleNamespace

    import torch

    from megapkl.serve.serve import SGLangCompatServer

    config = SimpleNamespace(num_hidden_layers=2, vocab_size=8, max_position_embeddings=16,
                             model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    engine = SimpleNamespace(config=config, model=torch.nn.Module(), device="cpu",
                             dtype=torch.float32)
    state = SimpleNamespace(engine=engine, model_path="m", served_model_name="m",
                            weight_version="default", enable_routed_experts=False)
    ours = set(SGLangCompatServer(state).model_info())
    want = _sglang_model_info_keys(sglang_source["http_server"])
    assert {"model_path", "served_model_name", "model_type", "architectures"} <= want
    assert ours == want
