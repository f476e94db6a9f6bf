"""pytest plugin: Megatron-LM's own unit tests on CPU ranks, with loco_megatron installed.

Loaded by :mod:`run` as ``torchrun ... -m pytest -p loco_mlm_plugin <checkout test file>`` (cwd:
the Megatron-LM checkout, so its ``tests`` package is the one imported). Before megatron is
imported it

1. switches the project's CPU emulation of CUDA on (:mod:`loco_megatron.emulation`);
2. makes every ``init_process_group`` use gloo (the tests ask for NCCL);
3. puts the stubs of :data:`STUBS` in place and replaces the Transformer Engine layer specs
   by megatron-core's local ones (:data:`TE_SPECS`), each with its reason;
4. makes ``parallel_state.destroy_model_parallel`` also destroy the process groups it forgets:
   megatron-core only drops its references, and under gloo every group keeps its threads and
   sockets, thousands per rank within one test file;
5. applies the shims of :data:`mlm_cpu_shims.SHIMS` for the CPU environment's gaps (torch's
   Adam standing in for TE's / apex's FusedAdam), each with its reason, in every mode alike;
6. installs loco_megatron with ``LoCoConfig(bits=LOCO_MLM_BITS)`` (``stock``: not installed).

Each rank writes ``{test id: outcome}`` to ``$LOCO_MLM_OUT/rank<RANK>.json`` after every test
(``passed``, ``failed`` or ``skipped``, with a failure's error lines or a skip's reason). A
module skipped as a whole (``pytest.skip(..., allow_module_level=True)`` or ``importorskip`` at
import) is recorded as one skipped ``<file>::<collection>`` entry with its reason, and a file
that collects no test as one skipped ``<file>::<no tests>`` entry, so neither reads as 0 / 0 / 0.
A test still running after ``LOCO_MLM_TEST_TIMEOUT`` seconds (default 120) counts as failed
("hung") and ends its rank.
"""

import json
import os
import sys
import threading
import types

#: module name -> (attributes, reason). Imported by Megatron-LM's test code, but unusable here.
STUBS = {
    "tests.test_utils.python_scripts.download_unit_tests_dataset": (
        {"download_and_extract_asset": lambda assets_dir: False},
        "tests/unit_tests/conftest.py downloads datasets from GitHub at session start (no "
        "network here; the distributed tests do not read them); the real module also needs "
        "click and requests"),
}


#: (module, TE function, local function, reason): Transformer Engine layer specs replaced by
#: megatron-core's local (pure PyTorch) ones, with the keyword arguments the local one takes.
TE_SPECS = [
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_with_transformer_engine_spec",
     "get_gpt_layer_local_spec",
     "Transformer Engine is GPU-only; the tests that build a model from the TE spec check DDP's "
     "gradient buffers and reductions, which are the same with megatron-core's local layers"),
    ("megatron.core.models.gpt.gpt_layer_specs",
     "get_gpt_layer_with_transformer_engine_submodules", "get_gpt_layer_local_submodules",
     "as above (the MoE tests take the MLP submodules of the TE layer spec)"),
]


def _local_layer_specs() -> None:
    import importlib
    import inspect

    for module_name, te_name, local_name, _reason in TE_SPECS:
        module = importlib.import_module(module_name)
        local = getattr(module, local_name, None)
        if getattr(module, te_name, None) is None or local is None:
            continue
        accepted = set(inspect.signature(getattr(module, "get_gpt_layer_local_submodules",
                                                 local)).parameters)

        def substitute(*args, _local=local, _accepted=accepted, **kwargs):
            return _local(*args, **{k: v for k, v in kwargs.items() if k in _accepted})

        setattr(module, te_name, substitute)


def _stub_modules() -> None:
    for name, (attrs, _reason) in STUBS.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        module.__loco_stub__ = True
        sys.modules[name] = module


def _force_gloo() -> None:
    import torch.distributed as dist

    init = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        kwargs.pop("device_id", None)  # an NCCL eager-init device
        return init("gloo", *args, **kwargs)

    dist.init_process_group = init_process_group
    new_group = dist.new_group

    def gloo_new_group(*args, **kwargs):
        kwargs["backend"] = "gloo" if kwargs.get("backend") in (None, "nccl") else kwargs["backend"]
        kwargs.pop("pg_options", None)  # NCCL options
        return new_group(*args, **kwargs)

    dist.new_group = gloo_new_group
    barrier = dist.barrier

    def gloo_barrier(group=None, async_op=False, device_ids=None):
        return barrier(group=group, async_op=async_op)  # device_ids: NCCL only

    dist.barrier = gloo_barrier


def _destroy_groups_with_model_parallel() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    destroy = ps.destroy_model_parallel

    def destroy_model_parallel(*args, **kwargs):
        result = destroy(*args, **kwargs)
        if dist.is_initialized():
            default = dist.distributed_c10d._get_default_group()
            for group in list(dist.distributed_c10d._world.pg_map):
                if group is not default and group is not dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(group)
        return result

    ps.destroy_model_parallel = destroy_model_parallel
    initialize = ps.initialize_model_parallel

    def initialize_model_parallel(*args, **kwargs):
        # megatron-core's local layers (TE_SPECS) draw their initial weights from the
        # model-parallel RNG tracker, which TE layers do not need: seed it as
        # megatron.training's initialize does (a test's own seed later wins)
        result = initialize(*args, **kwargs)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
        return result

    ps.initialize_model_parallel = initialize_model_parallel


def _apply_cpu_shims() -> None:
    import mlm_cpu_shims  # beside this plugin (run.py puts its directory on PYTHONPATH)

    mlm_cpu_shims.apply()


def _bits():
    value = os.environ.get("LOCO_MLM_BITS", "stock")
    return None if value == "stock" else int(value)


_OUTCOMES = {}


def _setup() -> None:
    """Everything before pytest imports the checkout's conftest.py (which imports megatron)."""
    from loco_megatron.emulation import activate

    _stub_modules()
    activate()
    _force_gloo()
    _local_layer_specs()
    _destroy_groups_with_model_parallel()
    _apply_cpu_shims()
    bits = _bits()
    if bits is not None:
        import loco_megatron

        loco_megatron.install(loco_megatron.LoCoConfig(bits=bits))


_setup()  # at import (-p loads this plugin before any conftest.py)


#: characters of a message kept (run.py compares them after normalising, then shortens them)
MESSAGE_CHARS = 2000


def _message(report) -> str:
    """A failure's error lines (``E ...``) or a skip's reason, joined, at most
    :data:`MESSAGE_CHARS` characters."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")[:MESSAGE_CHARS]
    lines = str(longrepr).strip().splitlines()
    errors = [x[1:].strip() for x in lines if x.startswith("E ")]
    return " ".join(errors or lines[-1:])[:MESSAGE_CHARS]


def pytest_collectreport(report):
    if not report.nodeid.endswith(".py"):  # a class, the session: its module reports too
        return
    if report.failed:  # e.g. a module that imports transformer_engine (GPU-only)
        _OUTCOMES[f"{report.nodeid}::<collection>"] = {"outcome": "failed",
                                                       "message": _message(report)}
    elif report.skipped:  # pytest.skip(allow_module_level=True) / importorskip at import
        _OUTCOMES[f"{report.nodeid}::<collection>"] = {"outcome": "skipped",
                                                       "message": _message(report)}


def pytest_collection_finish(session):
    if not session.items and not _OUTCOMES:  # nothing to run and no reason recorded yet
        for arg in session.config.args:
            _OUTCOMES[f"{arg.split('::')[0]}::<no tests>"] = {
                "outcome": "skipped", "message": "no tests collected"}
        _write()


#: seconds one test may run on a rank before it counts as hung (``LOCO_MLM_TEST_TIMEOUT``)
TEST_TIMEOUT = float(os.environ.get("LOCO_MLM_TEST_TIMEOUT", "120"))
_WATCHDOG = {}


def _hung(nodeid: str) -> None:
    """A test ran past :data:`TEST_TIMEOUT` (a collective waiting for a peer that never
    comes): record it as failed and end this rank, so the file's run ends in minutes."""
    _OUTCOMES[nodeid] = {"outcome": "failed",
                         "message": f"hung: still running after {TEST_TIMEOUT:.0f} s (killed)"}
    _write()
    os._exit(3)


def pytest_runtest_logstart(nodeid, location):
    timer = threading.Timer(TEST_TIMEOUT, _hung, args=(nodeid,))
    timer.daemon = True
    timer.start()
    _WATCHDOG[nodeid] = timer


def pytest_runtest_logfinish(nodeid, location):
    timer = _WATCHDOG.pop(nodeid, None)
    if timer is not None:
        timer.cancel()
    _write()  # after every test: a rank that dies later keeps what it did


def pytest_runtest_logreport(report):
    previous = _OUTCOMES.get(report.nodeid, {}).get("outcome")
    if report.failed:
        _OUTCOMES[report.nodeid] = {"outcome": "failed", "message": _message(report)}
    elif report.skipped and previous is None:
        _OUTCOMES[report.nodeid] = {"outcome": "skipped", "message": _message(report)}
    elif report.when == "call" and previous is None:
        _OUTCOMES[report.nodeid] = {"outcome": "passed"}


def _write() -> None:
    out = os.environ.get("LOCO_MLM_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(_OUTCOMES, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)


def pytest_sessionfinish(session, exitstatus):
    _write()
