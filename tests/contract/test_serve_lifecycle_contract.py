"""The lifecycle rules `megapkl serve` and the fleet's heartbeat rely on, read in the pinned SGLang's
own source (parsed, not imported: the rules are where the code puts them) and compared with what
the stand-in does (tests/serve/test_serve_lifecycle.py runs the stand-in's side)."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from megapkl.serve.serve import SGLangCompatServer, _env_bool


def _sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("the pinned sglang is not installed: run `bash tools/setup_env.sh test`")
    return Path(spec.origin).parent


def _tree(rel: str) -> ast.Module:
    return ast.parse((_sglang_root() / rel).read_text())


def _function(tree: ast.AST, name: str):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise AssertionError(f"SGLang has no function {name}")


def _routes(fn) -> set[str]:
    return {d.args[0].value for d in fn.decorator_list
            if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant)}


def test_health_is_the_generating_handler_unless_switched_off():
    http_server = _tree("srt/entrypoints/http_server.py")
    fn = _function(http_server, "health_generate")
    assert _routes(fn) == {"/health", "/health_generate"}
    src = ast.unparse(fn)
    assert "envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.get()" in src
    assert "GenerateReqInput(" in src and "'max_new_tokens': 1" in src
    environ = _tree("srt/environ.py")
    default = next(n.value for n in ast.walk(environ) if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", None)
                   == "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION")
    assert ast.unparse(default) == "EnvBool(True)"
    assert _env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True) is True  # the stand-in
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION" in Path(
        SGLangCompatServer.__init__.__code__.co_filename).read_text()


def test_health_timeout_env_and_default_are_sglangs():
    http_server = _tree("srt/entrypoints/http_server.py")
    node = next(n for n in http_server.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", None) == "HEALTH_CHECK_TIMEOUT")
    assert ast.unparse(node.value) == "int(os.getenv('SGLANG_HEALTH_CHECK_TIMEOUT', 20))"
    src = ast.unparse(_function(http_server, "health_generate"))
    assert "HEALTH_CHECK_TIMEOUT" in src and "status_code=503" in src
    mine = Path(SGLangCompatServer.__init__.__code__.co_filename).read_text()
    assert 'os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20)' in mine


def test_model_info_never_reaches_the_scheduler_and_server_info_reports_startup_time():
    """The fleet checks a released server with /model_info and reads its identity from
    /server_info's startup_time."""
    http_server = _tree("srt/entrypoints/http_server.py")
    info = _function(http_server, "model_info")
    assert not any(isinstance(n, ast.Await) for n in ast.walk(info))
    src = ast.unparse(_function(http_server, "server_info"))
    assert "'startup_time': _global_state.tokenizer_manager.startup_time" in src


def test_memory_refusals_raise_in_the_scheduler_which_ends_the_server():
    updater = _tree("srt/managers/scheduler_components/weight_updater.py")
    release = _function(updater, "release_memory_occupation")
    first = release.body[1] if isinstance(release.body[0], ast.Assign) else release.body[0]
    assert isinstance(first, ast.Assert) and "is_fully_idle" in ast.unparse(first.test)
    assert "self.offload_tags.remove(tag)" in ast.unparse(
        _function(updater, "resume_memory_occupation"))
    scheduler = _tree("srt/managers/scheduler.py")
    run = ast.unparse(_function(scheduler, "run_scheduler_process"))
    assert "except Exception:" in run and "parent_process.send_signal(signal.SIGQUIT)" in run
    dispatcher = next(n for n in ast.walk(_tree("utils.py"))
                      if isinstance(n, ast.ClassDef) and n.name == "TypeBasedDispatcher")
    dispatch = _function(dispatcher, "__call__")  # a handler's exception is not caught
    assert not any(isinstance(n, ast.Try) for n in ast.walk(dispatch))


def test_weights_are_read_and_loaded_by_the_one_scheduler():
    """/get_weights_by_name is a request to the scheduler, dispatched by the same dispatcher as
    the weight loads, so a read never sees a load half-way (the stand-in reads under its
    scheduler lock, which its loads hold)."""
    scheduler = _tree("srt/managers/scheduler.py")
    init = _function(scheduler, "init_request_dispatcher")
    handled = {ast.unparse(pair.elts[0]): ast.unparse(pair.elts[1]) for pair in ast.walk(init)
               if isinstance(pair, ast.Tuple) and len(pair.elts) == 2}
    for req in ("GetWeightsByNameReqInput", "UpdateWeightFromDiskReqInput",
                "UpdateWeightsFromTensorReqInput", "UpdateWeightsFromDistributedReqInput"):
        assert handled.get(req, "").startswith("self.weight_updater."), req
    mixin = _tree("srt/managers/tokenizer_control_mixin.py")
    assert "await self.get_weights_by_name_communicator(obj)" in ast.unparse(
        _function(mixin, "get_weights_by_name"))
    mine = ast.unparse(_function(ast.parse(Path(
        SGLangCompatServer.__init__.__code__.co_filename).read_text()), "weights_by_name"))
    assert "with self.state.scheduler:" in mine


def _source(rel: str, name: str) -> str:
    return ast.unparse(_function(_tree(rel), name))


def test_a_flush_that_succeeds_proves_the_idleness_a_release_asserts():
    """The release asserts `is_fully_idle(ignore_waiting=<paused>)`; /flush_cache runs only under
    the same test (and answers 400 otherwise), and an aborting pause returns once no request is in
    flight: megapkl's release after a failed generation pauses (abort), flushes (retried), then
    releases (weight_state.py)."""
    release = _source("srt/managers/scheduler_components/weight_updater.py",
                      "release_memory_occupation")
    assert "assert self.is_fully_idle(ignore_waiting=scheduler is not None and " \
           "scheduler._engine_paused)" in release
    assert "if self.is_fully_idle(ignore_waiting=self._engine_paused):" in _source(
        "srt/managers/scheduler.py", "flush_cache")
    pause = _source("srt/managers/tokenizer_manager.py", "pause_generation")
    assert "self.abort_request(abort_all=True)" in pause
    assert "await self.model_update_lock.is_locked()" in pause


def test_a_disk_load_post_processes_and_a_session_would_do_it_again():
    """update_weights_from_disk loads and post-processes on its own and never marks the session
    as loaded; end_weight_update then runs post_load_weights and, always, the quantization
    methods' post-processing: a disk load inside a session is post-processed twice, so megapkl
    loads from disk outside one (weights.py)."""
    scheduler_side = "srt/managers/scheduler_components/weight_updater.py"
    disk = _source(scheduler_side, "update_weights_from_disk")
    assert "loaded_weights" not in disk
    assert "run_post_load = not self._session.loaded_weights" in _source(scheduler_side,
                                                                          "end_weight_update")
    runner = "srt/model_executor/model_runner_components/weight_updater.py"
    end = _source(runner, "end_weight_update")
    assert "post_load_weights(self.get_model())" in end
    assert "DefaultModelLoader.postprocess_weights(" in end.split("if run_post_load:")[1]
    assert "loader.load_weights_and_postprocess(model, iter, target_device)" in _source(
        runner, "update_weights_from_disk")


def test_the_kv_cache_is_sized_from_the_memory_free_at_the_servers_start():
    """mem_fraction_static applies to the GPU memory free before the model loads
    (pre_model_load_memory), not to the whole GPU: what `megapkl plan` plans with."""
    sizing = _source("srt/mem_cache/kv_cache_configurator.py", "_profile_available_bytes")
    assert "slack_gb = pre_model_load_memory * (1 - get_schedule().mem_fraction_static)" in sizing
    assert "rest_memory = available_gpu_memory - slack_gb - mm_reservation_gb" in sizing
    measured = _source("srt/distributed/bootstrap.py", "measure_pre_model_load_memory")
    assert "pre_model_load_memory = get_available_gpu_memory(" in measured


def test_block_fp8_runs_deepgemm_which_compiles_every_shape_at_its_first_run():
    """What kernels.py plans the first start's timeout from."""
    assert "if deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM:\n        return " \
           "deepgemm_w8a8_block_fp8_linear_with_fallback" in _source(
               "srt/layers/quantization/fp8_utils.py", "_dispatch_auto_backend")
    compile_utils = "srt/layers/deep_gemm_wrapper/compile_utils.py"
    assert "typically 10-20 mins" in _source(compile_utils,
                                             "_maybe_compile_deep_gemm_one_type_all")
    text = (_sglang_root() / compile_utils).read_text()
    assert 'os.environ["DG_JIT_CACHE_DIR"] = envs.SGLANG_DG_CACHE_DIR.get()' in text
    environ = (_sglang_root() / "srt/environ.py").read_text()
    assert 'SGLANG_DG_CACHE_DIR = EnvStr(lambda: _default_cache_subdir("deep_gemm"))' in environ
    assert 'SGLANG_CACHE_DIR = EnvStr(os.path.expanduser("~/.cache/sglang"))' in environ
    assert "SGLANG_JIT_DEEPGEMM_PRECOMPILE = EnvBool(True)" in environ
