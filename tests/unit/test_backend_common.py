"""What every backend shares: the registry read from the classes, declared unsupported
features, the node-pool fit rule and the workdir walk."""

from __future__ import annotations

import os
from importlib.metadata import EntryPoint

import pytest

from airflow_skypilot.backends import registry
from airflow_skypilot.backends.base import Backend
from airflow_skypilot.backends.common import workdir
from airflow_skypilot.backends.common.features import Feature, required, unsupported_reason
from airflow_skypilot.backends.common.fit import PoolNode, fit_pool
from airflow_skypilot.exceptions import ConfigurationError
from airflow_skypilot.spec import load_task
from tests.fakes import FakeBackend


def _task(text: str, tmp_path=None):
    return load_task(text if tmp_path is None else str(tmp_path / "t.yaml"))


# --- registry --------------------------------------------------------------------------------

def test_built_in_backends_declare_their_names_and_connection_types():
    classes = registry.backend_classes()
    assert {"slurm", "kubernetes", "aws"} <= set(classes)
    types = registry.conn_types()
    assert types["ssh"] == types["slurm"] == "slurm"
    assert types["kubernetes"] == "kubernetes" and types["aws"] == "aws"
    for name, cls in classes.items():
        assert issubclass(cls, Backend) and cls.name == name and cls.conn_types


def test_a_backend_from_an_entry_point_is_found_without_touching_the_registry(monkeypatch):
    class Gcp(FakeBackend):
        name = "gcp_test"
        conn_types = ("google_cloud_platform",)
        unsupported_features = {Feature.VOLUMES: "no volumes here"}

    import tests.unit.test_backend_common as me

    monkeypatch.setattr(me, "GcpForEntryPoint", Gcp, raising=False)
    eps = [EntryPoint("gcp", "tests.unit.test_backend_common:GcpForEntryPoint",
                      registry.ENTRY_POINT_GROUP),
           EntryPoint("broken", "no.such.module:Backend", registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry, "entry_points",
                        lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(registry, "_classes", None)
    monkeypatch.setattr(registry, "load_errors", {})
    backend = registry.backend_for_connection("g1", conn_type="google_cloud_platform")
    assert isinstance(backend, Gcp) and backend.conn_id == "g1"
    assert "broken" in registry.load_errors, "a broken plugin is reported, not fatal"
    row = next(r for r in registry.describe() if r["name"] == "gcp_test")
    assert row["unsupported_features"] == {"volumes": "no volumes here"}
    monkeypatch.setattr(registry, "_classes", None)  # forget the test's classes


def test_an_unsupported_connection_type_names_the_connection_and_the_types():
    with pytest.raises(ConfigurationError) as err:
        registry.backend_for_connection("pg", conn_type="postgres")
    assert "'pg'" in str(err.value) and "'postgres'" in str(err.value)
    assert "kubernetes" in str(err.value) and "ssh" in str(err.value)


def test_an_undefined_connection_is_a_configuration_error(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_NOPE_NOT_HERE", raising=False)
    with pytest.raises(ConfigurationError, match="'nope_not_here' is not defined"):
        registry.backend_for_connection("nope_not_here")


# --- declared unsupported features ------------------------------------------------------------

@pytest.mark.parametrize(("yaml", "feature"), [
    ("resources: {accelerators: A100, use_spot: true}", Feature.SPOT),
    ("resources: {instance_type: p4d.24xlarge}", Feature.INSTANCE_TYPE),
    ("resources: {image_id: 'docker:ubuntu:22.04'}", Feature.DOCKER_IMAGE),
    ("resources: {image_id: ami-0123456789abcdef0}", Feature.MACHINE_IMAGE),
    ("resources: {accelerators: 'T4:0.5'}", Feature.FRACTIONAL_GPUS),
    ("workdir: {url: 'https://github.com/x/y'}", Feature.GIT_WORKDIR),
    ("file_mounts: {/d: s3://bucket/x}", Feature.S3_MOUNTS),
    ("file_mounts: {/d: gs://bucket/x}", Feature.OTHER_BUCKET_MOUNTS),
    ("file_mounts: {/d: {name: b, store: s3}}", Feature.STORAGE_MOUNTS),
])
def test_each_task_form_needs_its_feature(yaml, feature):
    task = load_task(yaml + "\nrun: echo")
    needs = required(task, task.candidates[0])
    assert feature in needs
    reason = unsupported_reason({feature: "not here"}, task, task.candidates[0])
    assert reason.endswith(": not here") and reason.split(":")[0]


def test_a_mount_reason_names_the_destination_and_scheme_never_a_secret_in_the_url():
    task = load_task("secrets: {HF_TOKEN: hf_s3cr3t}\nfile_mounts:\n"
                     "  /models: https://user:${HF_TOKEN}@host/m\n  /data: s3://b/${HF_TOKEN}\n"
                     "run: echo")
    assert task.file_mounts["/models"] == "https://user:hf_s3cr3t@host/m", "the job gets it"
    needs = required(task, task.candidates[0])
    assert needs[Feature.OTHER_BUCKET_MOUNTS] == "file_mounts /models (https://...)"
    assert needs[Feature.S3_MOUNTS] == "file_mounts /data (s3://...)"
    reason = unsupported_reason({Feature.OTHER_BUCKET_MOUNTS: "no"}, task, task.candidates[0])
    assert reason == "file_mounts /models (https://...): no"
    masked = load_task("secrets: {T: s3cr3t}\nfile_mounts: {/m/$T: gs://b}\nrun: echo")
    assert required(masked, masked.candidates[0]) == {
        Feature.OTHER_BUCKET_MOUNTS: "file_mounts /m/*** (gs://...)"}


def test_a_plain_task_needs_nothing_special():
    task = load_task("resources: {accelerators: A100:2, cpus: 4+}\nrun: echo")
    assert required(task, task.candidates[0]) == {}
    assert unsupported_reason({f: "x" for f in Feature}, task, task.candidates[0]) == ""


@pytest.mark.parametrize("name", ["slurm", "kubernetes", "aws"])
def test_built_in_backends_refuse_what_they_declare(name):
    cls = registry.backend_class(name)
    assert cls.unsupported_features, "every built-in backend lacks something"
    backend = cls("c")
    task = load_task("resources: {accelerators: A100, use_spot: true}\nrun: echo")
    spot = backend.unsupported(task, task.candidates[0])
    assert bool(spot) is (Feature.SPOT in cls.unsupported_features)


# --- node-pool fit ---------------------------------------------------------------------------

def _node(name, gpus=4, gfree=4, cpus=8, cfree=8, mem=16, mfree=16, usable=True, room=True):
    return PoolNode(name, cpus=cpus, cpus_free=cfree, memory_gb=mem, memory_free_gb=mfree,
                    gpus=gpus, gpus_free=gfree, usable=usable, has_room=room)


def _req(text: str):
    return load_task(f"resources: {text}\nrun: echo").candidates[0]


def test_fit_counts_nodes_that_can_take_one_share_now():
    nodes = [_node("a", gfree=4), _node("b", gfree=1), _node("c", gfree=4, usable=False)]
    fit = fit_pool(nodes, _req("{accelerators: A100:2}"), 1, "batch")
    assert fit.reason == "" and fit.nodes_total == 3 and fit.nodes_free == 1
    assert (fit.gpus_total, fit.gpus_free) == (12, 5), "down nodes' GPUs are not free"


@pytest.mark.parametrize(("req", "num_nodes", "reason"), [
    ("{accelerators: A100:8}", 1, "needs 8 A100 per node; nodes in batch have at most 4"),
    ("{accelerators: A100:1}", 3, "needs 3 nodes; batch has 2 with A100"),
    ("{cpus: 16+}", 1, "needs 16+ CPUs per node; nodes in batch have at most 8"),
    ("{memory: 64}", 1, "needs 64 GB per node; nodes in batch have at most 16 GB"),
])
def test_fit_says_why_a_shape_can_never_run(req, num_nodes, reason):
    fit = fit_pool([_node("a"), _node("b")], _req(req), num_nodes, "batch")
    assert fit.reason == reason and fit.nodes_free == 0


def test_fit_needs_cpus_memory_and_room_free_too():
    nodes = [_node("a", cfree=1), _node("b", mfree=2), _node("c", room=False), _node("d")]
    fit = fit_pool(nodes, _req("{accelerators: A100:1, cpus: 2, memory: 4}"), 1, "p")
    assert fit.nodes_free == 1
    assert fit_pool([_node("a", cfree=0)], _req("{cpus: 0.5}"), 1, "p").nodes_free == 0
    assert fit_pool([_node("a", cfree=0.5)], _req("{memory: 1}"), 1, "p",
                    min_cpus=1).nodes_free == 0


def test_an_empty_pool_never_fits():
    assert fit_pool([], _req("{accelerators: A100}"), 1, "p").reason == "no nodes in p with A100"


# --- workdir walk ----------------------------------------------------------------------------

def test_walk_skips_what_skyignore_lists_and_lists_parents_first(tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("x")
    (tmp_path / "src" / "deep").mkdir(parents=True)
    (tmp_path / "src" / "deep" / "a.py").write_text("a")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "big.log").write_text("x")
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / ".skyignore").write_text("# comment\nlogs\n*.tmp\n")
    (tmp_path / "c.tmp").write_text("c")
    rels = [(rel, is_dir) for _, rel, is_dir in workdir.walk(str(tmp_path))]
    assert rels == [(".git", True), ("src", True), (".skyignore", False), ("b.txt", False),
                    (".git/HEAD", False), ("src/deep", True), ("src/deep/a.py", False)]


def test_local_sources_start_at_the_task_files_folder(tmp_path):
    task = load_task("run: echo")
    task.base_dir = str(tmp_path)
    assert workdir.local_source(task, "data") == os.path.join(str(tmp_path), "data")
    assert workdir.local_source(task, "/abs/x/../y") == "/abs/y"
    assert workdir.local_source(task, "~/z") == os.path.expanduser("~/z")


def test_memory_per_cpu_counts_in_the_fit():
    """SkyPilot's ``memory: 4x`` is GB per CPU: 4 CPUs at 4x need 16 GB on one node."""
    req = _req("{cpus: 4, memory: 4x}")
    assert fit_pool([_node("a", mem=16, mfree=12)], req, 1, "p").nodes_free == 0
    assert fit_pool([_node("a", mem=16, mfree=16)], req, 1, "p").nodes_free == 1
    assert fit_pool([_node("a", mem=8, mfree=8)], req, 1, "p").reason == \
        "needs 16 (4x) GB per node; nodes in p have at most 8 GB"
