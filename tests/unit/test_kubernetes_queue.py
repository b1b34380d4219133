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
        active=0, selector=None, spread=False):
    meta = {"name": name, "namespace": "default", "labels": {LABEL_JOB: name},
            "creationTimestamp": ts(created), "annotations": {}}
    if cancelled:
        meta["annotations"][ANN_CANCELLED] = ts(NOW)
    tspec = {"containers": [{"name": "main", "resources": {"limits": {
        "nvidia.com/gpu": str(gpus)}, "requests": {"cpu": "8"}}}]}
    if selector:
        tspec["nodeSelector"] = selector
    template = {"spec": tspec}
    if spread:  # as manifests.job_manifest makes a multi-node Job: one rank per node
        template["metadata"] = {"labels": {LABEL_JOB: name}}
        tspec["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {LABEL_JOB: name}},
             "topologyKey": "kubernetes.io/hostname"}]}}
    return {"metadata": meta, "spec": {"parallelism": parallelism, "completions": parallelism,
                                       "suspend": False, "template": template},
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
    pods = [pod("a-p", 8, "n0", started=NOW - 1800, ours=True),
            pod("b-p", 8, "n1", started=NOW - 600, ours=True)]
    # our finished pods ran 1 h or 2 h: "a" (30 min old) ends at the median of those over
    # 30 min (1.5 h), i.e. in 1 h; "b" also at +1.5 h from its start: in 1h20m
    runs = _history(3, 3600) + _history(3, 7200)
    got = offer_for(A100, nodes, pods, own_pods=runs)
    assert not got.free_now and got.est_start == NOW - 1800 + 5400
    assert got.details["estimate"] == ("from running pods' ages against the median run of 6 "
                                       "finished pods of ours")
    assert got.notes == [f"est. {got.details['estimate']}"]
    assert run_times(runs) == [3600.0] * 3 + [7200.0] * 3
    # other users' pods: our runs say nothing of theirs (they were read as ours; in the
    # scheduling benchmark that put jobs in queues that did not move): unknown
    others = [pod("a", 8, "n0", started=NOW - 1800), pod("b", 8, "n1", started=NOW - 600)]
    got = offer_for(A100, nodes, others, own_pods=runs)
    assert got.est_start is None and got.details["estimate"] == "unknown"


def test_a_pending_pod_ahead_binds_first_as_room_frees():
    nodes = [node("n0")]
    pods = [pod("a-p", 8, "n0", started=NOW - 600, ours=True),
            pod("waiting", 8, created=NOW - 300)]
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


def test_a_gpu_type_under_several_labels_is_offered_where_it_starts_soonest():
    # two full SXM nodes and one idle PCIe node, all H100: the label most nodes share was
    # chosen, and the idle node was never counted ("0 of 16 H100 free")
    def h100(name, product):
        n = node(name, 8)
        del n["metadata"]["labels"]["skypilot.co/accelerator"]
        n["metadata"]["labels"]["nvidia.com/gpu.product"] = product
        return n

    nodes = [h100("s1", "NVIDIA-H100-80GB-HBM3"), h100("s2", "NVIDIA-H100-80GB-HBM3"),
             h100("p1", "NVIDIA-H100-PCIe")]
    busy = [pod("a", 8, "s1", started=NOW - 60), pod("b", 8, "s2", started=NOW - 60)]
    got = offer_for({"accelerators": "H100:8"}, nodes, busy)
    assert (got.free_now, got.gpus_free, got.gpus_total) == (True, 8, 8)
    assert got.details["node_selector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-PCIe"}
    # all idle: the label most nodes share, as before
    got = offer_for({"accelerators": "H100:8"}, nodes, [])
    assert (got.free_now, got.gpus_total) == (True, 16)
    assert got.details["node_selector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    # all full: the one whose running pods end first
    ending = [pod("a", 8, "s1", started=NOW - 60, deadline=7200),
              pod("b", 8, "s2", started=NOW - 60, deadline=7200),
              pod("c", 8, "p1", started=NOW - 60, deadline=600)]
    got = offer_for({"accelerators": "H100:8"}, nodes, ending)
    assert got.est_start == NOW - 60 + 600
    assert got.details["node_selector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-PCIe"}


def test_a_multi_node_job_ahead_takes_one_node_per_rank():
    # its ranks may not share a node (pod anti-affinity): two 4-GPU ranks take 4 GPUs on each
    # of two empty 8-GPU nodes, so an 8-GPU job is not free (the model packed both on one)
    nodes = [node("n0"), node("n1")]
    ahead = job("sky-ddp-1", gpus=4, parallelism=2, spread=True)
    got = offer_for({"accelerators": "A100:8"}, nodes, [], jobs=[ahead])
    assert (got.free_now, got.nodes_free, got.gpus_free) == (False, 0, 8)
    # its pods created, not bound yet, and one rank bound already: alike
    ranks = [pod(f"sky-ddp-1-{i}", 4, ours=True, created=NOW - 2) for i in range(2)]
    for p in ranks:
        p["metadata"]["labels"] = {LABEL_JOB: "sky-ddp-1"}
        p["spec"]["affinity"] = ahead["spec"]["template"]["spec"]["affinity"]
    assert not offer_for({"accelerators": "A100:8"}, nodes, ranks).free_now
    ranks[0]["spec"]["nodeName"], ranks[0]["status"]["phase"] = "n0", "Running"
    assert not offer_for({"accelerators": "A100:8"}, nodes, ranks).free_now
    # a one-node job's pods (no anti-affinity) still pack: 8 GPUs left on n1
    assert offer_for({"accelerators": "A100:8"}, nodes, [], jobs=[job("a", 4, parallelism=2)]
                     ).free_now


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
                                           "running pod(s) without a deadline whose end our "
                                           "runs cannot tell (another user's, or older than "
                                           "any of ours)")
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


def test_the_tasks_pod_config_node_selector_narrows_the_nodes_counted():
    n0, n1 = node("n0"), node("n1")
    n0["metadata"]["labels"]["cloud.google.com/gke-nodepool"] = "reserved"
    n1["metadata"]["labels"]["cloud.google.com/gke-nodepool"] = "general"
    pods = [pod("busy", 8, "n0", started=NOW - 60)]  # the reserved pool is full
    view = cluster_view([n0, n1], pods, "default")
    view.now = NOW

    def offer_with(selector):
        task = load_task({"run": "x", "resources": {"accelerators": "A100:4"},
                          "config": {"kubernetes": {"pod_config": {"spec": {
                              "nodeSelector": selector}}}}})
        return offers.offer("k", "kubernetes", SETTINGS, task, task.candidates[0], view,
                            unsupported="", bundle_error="")

    # its pods may go only to the reserved pool: not free (n1's free GPUs were counted)
    got = offer_with({"cloud.google.com/gke-nodepool": "reserved"})
    assert (got.free_now, got.nodes_total, got.gpus_free) == (False, 1, 0)
    assert offer_with({"cloud.google.com/gke-nodepool": "general"}).free_now
    none = offer_with({"cloud.google.com/gke-nodepool": "gone"})
    assert not none.fits and "pod_config nodeSelector" in none.reason


def test_the_tasks_pod_config_tolerations_and_node_affinity_are_counted():
    # n0 is tainted for one team (its pods tolerate it through the task's pod_config); n1 is
    # another pool, full. Before, the taint hid n0 ("no fit" or queued where n0 starts it now),
    # and a required node affinity was ignored (n1's room counted for a job kept off it)
    n0, n1 = node("n0"), node("n1")
    n0["spec"]["taints"] = [{"key": "team", "value": "vision", "effect": "NoSchedule"}]
    n0["metadata"]["labels"]["pool"] = "vision"
    n1["metadata"]["labels"]["pool"] = "general"
    view = cluster_view([n0, n1], [pod("busy", 8, "n1", started=NOW - 60)], "default")
    view.now = NOW

    # tolerations in a pod_config are the connection's to allow (refused by default)
    allowing = KubernetesSettings.from_extra("k", {"cluster_context": "ctx",
                                                   "allow_privileged_pod_config": True})

    def offer_with(spec):
        task = load_task({"run": "x", "resources": {"accelerators": "A100:4"},
                          "config": {"kubernetes": {"pod_config": {"spec": spec}}}})
        return offers.offer("k", "kubernetes", allowing, task, task.candidates[0], view,
                            unsupported="", bundle_error="")

    tolerate = {"tolerations": [{"key": "team", "operator": "Equal", "value": "vision",
                                 "effect": "NoSchedule"}]}
    assert offer_with(tolerate).free_now
    assert not offer_with({}).free_now  # n0 refuses the job's pods: only full n1 is left

    def affinity(pool):
        return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "pool", "operator": "In", "values": [pool]}]}]}}}}

    general = offer_with(affinity("general"))
    assert (general.free_now, general.nodes_total, general.gpus_free) == (False, 1, 0)
    assert offer_with({**affinity("vision"), **tolerate}).free_now
    none = offer_with(affinity("gone"))
    assert not none.fits and "required node affinity" in none.reason


def test_a_pods_requests_count_its_native_sidecars_beside_its_containers():
    from airflow_skypilot.backends.kubernetes.cluster import pod_requests

    def c(cpu, mem, **kw):
        return {"name": "c", "resources": {"requests": {"cpu": cpu, "memory": mem}}, **kw}

    spec = {"containers": [c("4", "8Gi")],
            "initContainers": [c("1", "1Gi", restartPolicy="Always"), c("6", "1Gi")]}
    got = pod_requests({"spec": spec})
    # the sidecar runs beside the container: 4 + 1 CPU, 8 + 1 GiB; the plain init container
    # (6 CPU, with the sidecar before it: 7) is the larger CPU need, which runs alone first
    assert (got["cpu"], got["memory"]) == (7.0, 9 * 2**30)
    spec["initContainers"] = [c("2", "2Gi", restartPolicy="Always")]
    assert pod_requests({"spec": spec})["cpu"] == 6.0  # was 4: the sidecar's max, not its sum


def test_a_pending_pods_required_node_affinity_keeps_it_off_other_nodes():
    # another team's pod, pending for an hour, for H100 nodes only (Karpenter style): it does
    # not take the idle A100 node (it did: "8 free A100 taken by 1 pod(s) pending ahead")
    def wants(op, values=None, key="skypilot.co/accelerator", fields=False):
        p = pod("other-team", 8, created=NOW - 3600)
        expr = {"key": key, "operator": op, **({"values": values} if values else {})}
        term = {"matchFields" if fields else "matchExpressions": [expr]}
        p["spec"]["affinity"] = {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}
        return p

    nodes = [node("a0", 8, "a100")]
    a100 = {"accelerators": "A100:8"}
    assert offer_for(a100, nodes, [wants("In", ["h100"])]).free_now
    assert offer_for(a100, nodes, [wants("NotIn", ["a100"])]).free_now
    assert offer_for(a100, nodes, [wants("Exists", key="h100-only")]).free_now
    assert offer_for(a100, nodes, [wants("In", ["b0"], key="metadata.name", fields=True)]
                     ).free_now
    # one that may land there still takes it first
    for p in (wants("In", ["a100", "h100"]), wants("DoesNotExist", key="h100-only"),
              wants("In", ["a0"], key="metadata.name", fields=True)):
        taken = offer_for(a100, nodes, [p])
        assert not taken.free_now and taken.details["reserved_by_pending"] == 8
