"""Kubernetes offers beyond "what is free": the work ahead of a new job (pods not bound yet, our
Jobs whose pods do not exist yet), a full cluster's start estimate from pod ages and deadlines,
an explicit "unknown", CPU-only candidates on GPU nodes. Node, pod and Job JSON as the API
returns them; no server."""

from __future__ import annotations

from datetime import datetime, timezone

from airflow_skypilot.backends.kubernetes import offers
from airflow_skypilot.backends.kubernetes.cluster import cluster_view
from airflow_skypilot.backends.kubernetes.names import ANN_CANCELLED, LABEL_JOB
from airflow_skypilot.backends.kubernetes.queue import run_times, waiting_jobs
from airflow_skypilot.backends.kubernetes.settings import KubernetesSettings
from airflow_skypilot.spec import load_task

NOW = 1_800_000_000.0
SETTINGS = KubernetesSettings.from_extra("k", {"cluster_context": "ctx"})


def ts(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def node(name, gpus=8, gpu_label="a100"):
    labels = {"kubernetes.io/hostname": name}
    if gpus:
        labels["skypilot.co/accelerator"] = gpu_label
    return {"metadata": {"name": name, "labels": labels}, "spec": {},
            "status": {"allocatable": {"cpu": "96", "memory": "1024Gi",
                                       "nvidia.com/gpu": str(gpus), "pods": "110"},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def pod(name, gpus, node_name=None, *, ns="research", started=None, created=None, ours=False,
        phase=None, deadline=None, selector=None, tolerations=None):
    spec = {"containers": [{"name": "main", "resources": {"requests": {
        "nvidia.com/gpu": str(gpus), "cpu": "8"}}}]}
    if node_name:
        spec["nodeName"] = node_name
    if deadline:
        spec["activeDeadlineSeconds"] = deadline
    if selector:
        spec["nodeSelector"] = selector
    if tolerations:
        spec["tolerations"] = tolerations
    meta = {"name": name, "namespace": "default" if ours else ns,
            "creationTimestamp": ts(created or (started or NOW) - 1)}
    if ours:
        meta["labels"] = {LABEL_JOB: name.rsplit("-", 1)[0]}
    status = {"phase": phase or ("Running" if node_name else "Pending")}
    if started:
        status["startTime"] = ts(started)
    return {"metadata": meta, "spec": spec, "status": status}


def finished(name, ran_s, ended=NOW - 600):
    p = pod(name, 1, "n0", ours=True, started=ended - ran_s, phase="Succeeded")
    p["status"]["containerStatuses"] = [{"name": "main", "state": {"terminated": {
        "startedAt": ts(ended - ran_s), "finishedAt": ts(ended), "exitCode": 0}}}]
    return p


def job(name, gpus=4, *, parallelism=1, created=NOW - 2, cancelled=False, conditions=(),
        active=0, selector=None):
    meta = {"name": name, "namespace": "default", "labels": {LABEL_JOB: name},
            "creationTimestamp": ts(created), "annotations": {}}
    if cancelled:
        meta["annotations"][ANN_CANCELLED] = ts(NOW)
    tspec = {"containers": [{"name": "main", "resources": {"limits": {
        "nvidia.com/gpu": str(gpus)}, "requests": {"cpu": "8"}}}]}
    if selector:
        tspec["nodeSelector"] = selector
    return {"metadata": meta, "spec": {"parallelism": parallelism, "completions": parallelism,
                                       "suspend": False, "template": {"spec": tspec}},
            "status": {"active": active, "conditions": [{"type": c, "status": "True"}
                                                        for c in conditions]}}


def offer_for(resources, nodes, pods, jobs=None, own_pods=None, num_nodes=1):
    view = cluster_view(nodes, pods, "default", jobs=jobs, own_pods=own_pods)
    view.now = NOW
    task = load_task({"run": "x", "num_nodes": num_nodes, "resources": resources})
    return offers.offer("k", "kubernetes", SETTINGS, task, task.candidates[0], view,
                        unsupported="", bundle_error="")


A100 = {"accelerators": "A100:4"}


def test_a_pod_not_bound_yet_takes_the_free_gpus_first():
    nodes = [node("n0"), node("n1")]
    pods = [pod("busy", 8, "n0", started=NOW - 60), pod("busy2", 4, "n1", started=NOW - 60),
            pod("newcomer", 3, created=NOW - 1)]
    got = offer_for(A100, nodes, pods)
    assert not got.free_now and got.details["gpus_idle"] == 4 and got.gpus_free == 1
    assert got.details["reserved_by_pending"] == 3 and got.details["held_for"] == ["newcomer"]
    assert got.notes[0] == "3 free A100 taken by 1 pod(s) pending ahead"
    # a pod that can never fit (more GPUs than a node has) takes nothing
    assert offer_for(A100, nodes, pods[:2] + [pod("huge", 9)]).free_now


def test_our_job_without_pods_yet_counts_ahead_of_the_next_placement():
    nodes = [node("n0")]
    first = job("sky-sweep-1", gpus=4)  # created a moment ago: the Job controller lags
    got = offer_for({"accelerators": "A100:6"}, nodes, [], jobs=[first])
    assert not got.free_now and got.gpus_free == 4
    assert got.details["reserved_by_pending"] == 4 and got.details["pending_ours"] == 1
    assert got.notes[0] == "4 free A100 taken by 1 pod(s) pending ahead, 1 of them ours"
    assert offer_for({"accelerators": "A100:4"}, nodes, [], jobs=[first]).free_now
    # once its pod exists it is counted as that pod, not twice
    bound = pod("sky-sweep-1-x7", 4, "n0", ours=True, started=NOW - 1)
    got = offer_for({"accelerators": "A100:4"}, nodes, [bound], jobs=[first])
    assert got.free_now and "reserved_by_pending" not in got.details
    # cancelled, finished and running Jobs are not work ahead
    others = [job("a", cancelled=True), job("b", conditions=("Complete",)), job("c", active=1)]
    assert waiting_jobs(others, []) == []
    two = waiting_jobs([job("d", gpus=2, parallelism=2)], [])
    assert [p.requests["nvidia.com/gpu"] for p in two] == [2.0, 2.0] and two[0].ours


def test_the_jobs_a_view_counts_are_seen_by_name_and_no_others():
    # the ledger's "already counted" check (ledger.hold): a Job waiting for its pod, or whose
    # pod is in the pod list; not one whose pod came after that list (in neither count)
    nodes = [node("n0")]
    waiting = job("sky-wait", gpus=2)
    bound = job("sky-bound", gpus=2, active=1)
    late = job("sky-late", gpus=2, active=1)
    pods = [pod("sky-bound-x1", 2, "n0", ours=True, started=NOW - 5)]
    own = pods + [pod("sky-late-x2", 2, ours=True, created=NOW)]
    got = offer_for(A100, nodes, pods, jobs=[waiting, bound, late], own_pods=own)
    assert got.jobs_seen == {"sky-wait", "sky-bound"}
    # without our Jobs (or pods) listed nothing is said: the ledger goes by time alone
    assert offer_for(A100, nodes, pods).jobs_seen is None
    assert offer_for(A100, nodes, None, jobs=[waiting]).jobs_seen is None


def _history(n, ran_s):
    return [finished(f"sky-old{i}-p", ran_s) for i in range(n)]


def test_a_full_cluster_is_estimated_from_running_pods_ages():
    nodes = [node("n0"), node("n1")]
    pods = [pod("a", 8, "n0", started=NOW - 1800), pod("b", 8, "n1", started=NOW - 600)]
    # our finished pods ran 1 h or 2 h: "a" (30 min old) ends at the median of those over
    # 30 min (1.5 h), i.e. in 1 h; "b" also at +1.5 h from its start: in 1h20m
    runs = _history(3, 3600) + _history(3, 7200)
    got = offer_for(A100, nodes, pods, own_pods=runs)
    assert not got.free_now and got.est_start == NOW - 1800 + 5400
    assert got.details["estimate"] == ("from running pods' ages against the median run of 6 "
                                       "finished pods of ours")
    assert got.notes == [f"est. {got.details['estimate']}"]
    assert run_times(runs) == [3600.0] * 3 + [7200.0] * 3


def test_a_pending_pod_ahead_binds_first_as_room_frees():
    nodes = [node("n0")]
    pods = [pod("a", 8, "n0", started=NOW - 600), pod("waiting", 8, created=NOW - 300)]
    got = offer_for(A100, nodes, pods, own_pods=_history(5, 3600))
    # "a" ends in 50 min and "waiting" takes the node for a typical run (1 h) first
    assert got.est_start == NOW - 600 + 3600 + 3600


def test_work_ahead_bound_on_another_gpu_type_does_not_break_the_estimate():
    # a pod for the H100 node binds there in the model: it frees nothing on the A100 pool
    # (it raised KeyError 'h0' before, and the whole connection was skipped)
    nodes = [node("a0", 8, "a100"), node("h0", 8, "h100")]
    pods = [pod("busy", 8, "a0", started=NOW - 7200, deadline=4 * 3600),
            pod("h100-job", 4, created=NOW - 5, selector={"skypilot.co/accelerator": "h100"})]
    got = offer_for({"accelerators": "A100:4"}, nodes, pods, own_pods=_history(5, 3600))
    assert not got.free_now and got.est_start == NOW - 7200 + 4 * 3600


def test_pod_deadlines_bound_the_estimate_without_history():
    got = offer_for(A100, [node("n0")], [pod("a", 8, "n0", started=NOW - 100, deadline=900)])
    assert got.est_start == NOW - 100 + 900
    assert got.details["estimate"] == "from 1 pod deadline(s) (activeDeadlineSeconds)"


def test_where_nothing_can_be_said_the_start_is_an_explicit_unknown():
    got = offer_for(A100, [node("n0")], [pod("a", 8, "n0", started=NOW - 100)],
                    own_pods=_history(2, 3600))
    assert got.fits and not got.free_now and got.est_start is None
    assert got.details["estimate"] == "unknown"
    assert got.details["estimate_why"] == ("2 finished run(s) of ours on record, 5 needed; 1 "
                                           "running pod(s) older than any run of ours and "
                                           "without a deadline")
    assert got.notes == [f"start unknown: {got.details['estimate_why']}"]
    # older than every run of ours: no end can be said for it
    old = offer_for(A100, [node("n0")], [pod("a", 8, "n0", started=NOW - 9000)],
                    own_pods=_history(5, 3600))
    assert old.est_start is None and old.details["estimate"] == "unknown"


def test_cpu_only_candidates_are_marked_where_only_gpu_nodes_have_room():
    got = offer_for({"cpus": 4}, [node("n0")], [])
    assert got.details["gpu_place"] is True and "CPU-only on GPU nodes" in got.notes
    mixed = offer_for({"cpus": 4}, [node("n0"), node("c0", gpus=0)], [])
    assert mixed.details["gpu_place"] is False
    assert "gpu_place" not in offer_for(A100, [node("n0")], []).details
