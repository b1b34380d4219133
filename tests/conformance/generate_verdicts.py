"""Generate SkyPilot's own verdicts for the conformance corpus.

NOT a test module (no ``test_`` prefix): it needs the real SkyPilot, which is
not a dependency of airflow-skypilot. Run it with a Python that has
``skypilot`` installed, e.g.::

    /tmp/skyvenv/bin/python tests/conformance/generate_verdicts.py

It writes ``tests/conformance/skypilot_verdicts.json``. See README.md.

Everything runs offline:
  * HOME is a fresh temp dir (no ~/.sky state, no kubeconfig, no cloud creds).
  * SKYPILOT_DISABLE_USAGE_COLLECTION=1.
  * Every socket connect / DNS lookup is refused in-process; a case that made
    SkyPilot try the network is recorded with ``network_attempted``.
  * The accelerator catalog ``common/accelerators.csv`` (the only catalog the
    offline checks need: accelerator-name canonicalisation) is seeded into the
    temp HOME from the copy embedded below, so no download is attempted.

Per case the loader is the one ``sky launch`` / ``sky jobs launch`` use for a
YAML entrypoint (``sky.utils.dag_utils.load_chain_dag_from_yaml``, with
``env_overrides`` / ``secret_overrides`` as ``--env`` / ``--secret`` pass
them), followed by the offline-checkable part of the validation that
``sdk.validate`` (client side) and the API server's ``/validate``
(``Dag.validate(skip_file_mounts=True, skip_workdir=True)``) perform, and the
``sky jobs launch`` defaulting (``fill_default_config_in_dag_for_job_launch``).
"""
import contextlib
import copy
import io
import json
import os
import re
import socket
import sys
import tempfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
CASES_DIR = os.path.join(HERE, 'cases')
OUT_PATH = os.path.join(HERE, 'skypilot_verdicts.json')

# SkyPilot catalog v8 ``common/accelerators.csv`` (skypilot-org/skypilot-catalog,
# catalogs/v8/common/accelerators.csv). Only used offline to seed the catalog
# cache so that accelerator-name canonicalisation (Resources.validate) works
# without downloading it.
_CATALOG_ACCELERATORS = [
    ('A10', ['Azure', 'Lambda', 'OCI']),
    ('A100', ['AWS', 'Azure', 'Cudo', 'GCP', 'Lambda', 'OCI', 'PrimeIntellect', 'Seeweb', 'Vast']),
    ('A100-80GB', [
        'AWS', 'Azure', 'GCP', 'Lambda', 'OCI', 'Paperspace', 'PrimeIntellect', 'RunPod', 'scp',
    ]),
    ('A100-80GB-SXM', ['RunPod']),
    ('A10G', ['AWS']),
    ('A30', ['Seeweb']),
    ('A40', ['Cudo', 'RunPod', 'Vast']),
    ('A4000', ['Paperspace', 'PrimeIntellect']),
    ('A6000', ['Lambda', 'PrimeIntellect']),
    ('A800', ['Cudo']),
    ('B200', ['AWS', 'Lambda', 'PrimeIntellect', 'RunPod', 'nebius']),
    ('GH200', ['Lambda']),
    ('GTX1660S', ['Vast']),
    ('Gaudi HL-205', ['AWS']),
    ('H100', [
        'AWS', 'Azure', 'DO', 'GCP', 'Hyperbolic', 'Lambda', 'OCI', 'Paperspace', 'PrimeIntellect',
        'RunPod', 'Seeweb', 'Vast', 'nebius',
    ]),
    ('H100-MEGA', ['GCP']),
    ('H100-NVL', ['RunPod']),
    ('H100-NVLINK', ['Fluidstack']),
    ('H100-SXM', ['Cudo', 'RunPod']),
    ('H200', ['AWS', 'GCP', 'OCI', 'PrimeIntellect', 'Seeweb', 'Vast', 'nebius']),
    ('H200-SXM', ['RunPod']),
    ('K80', ['Azure']),
    ('L4', ['AWS', 'GCP', 'RunPod', 'Seeweb']),
    ('L40', ['PrimeIntellect', 'RunPod']),
    ('L40S', ['AWS', 'Cudo', 'OCI', 'PrimeIntellect', 'RunPod', 'Seeweb', 'Vast', 'nebius']),
    ('M4000', ['Paperspace']),
    ('M60', ['Azure']),
    ('MI300X', ['RunPod']),
    ('P100', ['GCP', 'OCI']),
    ('P4', ['GCP']),
    ('P4000', ['Paperspace']),
    ('RTX3060', ['Vast']),
    ('RTX3070', ['Vast']),
    ('RTX3080', ['Vast']),
    ('RTX3090', ['RunPod', 'Vast']),
    ('RTX4000-Ada', ['RunPod']),
    ('RTX4090', ['RunPod', 'Vast']),
    ('RTX5060', ['Vast']),
    ('RTX5090', ['Vast']),
    ('RTX6000', ['Lambda', 'Seeweb']),
    ('RTX6000-Ada', ['RunPod', 'Vast']),
    ('RTX6000Ada', ['PrimeIntellect']),
    ('RTXA4000', ['RunPod']),
    ('RTXA4500', ['RunPod']),
    ('RTXA5000', ['Cudo', 'RunPod']),
    ('RTXA6000', ['Cudo', 'RunPod', 'Seeweb', 'Vast']),
    ('RTXPRO6000S', ['Vast']),
    ('RTXPRO6000WS', ['Vast']),
    ('Radeon MI25', ['Azure']),
    ('Radeon Pro V520', ['AWS']),
    ('T4', ['AWS', 'Azure', 'GCP']),
    ('T4g', ['AWS']),
    ('V100', [
        'AWS', 'Azure', 'Cudo', 'GCP', 'IBM', 'Lambda', 'OCI', 'Paperspace', 'PrimeIntellect',
        'Vast',
    ]),
    ('V100-32GB', ['AWS', 'Azure', 'Paperspace', 'scp']),
    ('tpu-v2', ['GCP']),
    ('tpu-v3', ['GCP']),
    ('tpu-v4', ['GCP']),
    ('tpu-v5litepod', ['GCP']),
    ('tpu-v5p', ['GCP']),
    ('tpu-v6e', ['GCP']),
]


def _accelerators_csv():
    out = ['AcceleratorName,Clouds']
    for name, clouds in _CATALOG_ACCELERATORS:
        out.append(f'{name},"{clouds!r}"')
    return '\n'.join(out) + '\n'


ACCELERATORS_CSV = _accelerators_csv()
CATALOG_NAMES = [name for name, _ in _CATALOG_ACCELERATORS]

_ANSI_RE = re.compile(r'\x1b\[[0-9;]*m')

# Hosts SkyPilot tried to reach while processing the current case.
_NETWORK_ATTEMPTS = []


class OfflineError(OSError):
    """Raised instead of opening any network connection."""


def _install_network_guard():

    def _refuse_getaddrinfo(host, *args, **kwargs):
        _NETWORK_ATTEMPTS.append(str(host))
        raise OfflineError(f'offline: refused DNS lookup of {host!r}')

    def _refuse_connect(self, address):
        if self.family == socket.AF_UNIX:
            return _orig_connect(self, address)
        _NETWORK_ATTEMPTS.append(str(address))
        raise OfflineError(f'offline: refused connect to {address!r}')

    _orig_connect = socket.socket.connect
    socket.getaddrinfo = _refuse_getaddrinfo
    socket.socket.connect = _refuse_connect
    socket.socket.connect_ex = _refuse_connect


def _setup_offline_home():
    home = tempfile.mkdtemp(prefix='skyconf-home-')
    os.environ['HOME'] = home
    os.environ['SKYPILOT_DISABLE_USAGE_COLLECTION'] = '1'
    os.environ.pop('KUBECONFIG', None)
    os.environ.pop('SKYPILOT_API_SERVER_ENDPOINT', None)
    cat_dir = os.path.join(home, '.sky', 'catalogs', 'v8', 'common')
    os.makedirs(cat_dir, exist_ok=True)
    with open(os.path.join(cat_dir, 'accelerators.csv'), 'w',
              encoding='utf-8') as f:
        f.write(ACCELERATORS_CSV)
    return home


def _first_line(msg):
    msg = _ANSI_RE.sub('', str(msg)).strip()
    # Keep the verdicts file machine-independent.
    msg = msg.replace(CASES_DIR + os.sep, '')
    if os.environ.get('HOME'):
        msg = msg.replace(os.environ['HOME'], '~')
    return msg.splitlines()[0] if msg else ''


def _error_kind(exc):
    # pylint: disable=import-outside-toplevel
    import yaml
    from sky import exceptions
    if isinstance(exc, exceptions.InvalidSkyPilotConfigError):
        return 'schema'
    if isinstance(exc, CliNotYamlError):
        return 'not_yaml_task'
    if isinstance(exc, yaml.YAMLError):
        return 'yaml'
    if isinstance(exc, ValueError):
        return 'value'
    # AssertionError / AttributeError / TypeError / KeyError ...: SkyPilot
    # rejects the YAML, but by crashing rather than with a user error.
    return 'crash'


def _error_record(exc, stage):
    return {
        'accepted': False,
        'rejected_at': stage,
        'load_time': stage == 'load',
        'error_class': type(exc).__name__,
        'error_kind': _error_kind(exc),
        'error': _first_line(exc) or type(exc).__name__,
    }


def _jsonable(value):
    """Converts SkyPilot values (enums, SecretStr, None keys) to JSON."""
    import enum  # pylint: disable=import-outside-toplevel
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        # JSON has no null keys: image_id {None: img} -> {"null": img}.
        return {('null' if k is None else str(k)): _jsonable(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return value  # keep floats as floats (A100: 0.5 vs 1.0 matters)
    return value


def _resource_record(r):
    # Read private fields so that no catalog lookup (network) is triggered by
    # the inferring properties (accelerators/cpus/memory from instance type).
    # pylint: disable=protected-access
    autostop = r.autostop_config
    rec = {
        'cloud': str(r.cloud) if r.cloud is not None else None,
        'region': r.region,
        'zone': r.zone,
        'infra': r.infra.to_str(),
        'accelerators': _jsonable(r._accelerators),
        'accelerator_args': _jsonable(r._accelerator_args),
        'cpus': r._cpus,
        'memory': r._memory,
        'instance_type': r._instance_type,
        'use_spot': r.use_spot,
        'use_spot_specified': r.use_spot_specified,
        'disk_size': r.disk_size,
        'disk_size_specified': r.disk_size_specified,
        'disk_tier': _jsonable(r.disk_tier),
        'network_tier': _jsonable(r.network_tier),
        'ports': r.ports,
        'image_id': _jsonable(r.image_id),
        'docker_image': r._docker_image,
        'labels': r.labels,
        'autostop': (_jsonable(autostop.to_yaml_config())
                     if autostop is not None else None),
        'job_recovery': _jsonable(r.job_recovery),
        'priority': r.priority,
        'max_hourly_cost': r.max_hourly_cost,
        'local_disk': r._local_disk,
        'hooks': _jsonable(r.hooks),
        'volumes': _jsonable(r.volumes),
        'cluster_config_overrides': _jsonable(r._cluster_config_overrides),
        'no_missing_accel_warnings': r.no_missing_accel_warnings,
    }
    return rec


def _resources_records(task):
    recs = [_resource_record(r) for r in task.resources]
    if isinstance(task.resources, list):
        return recs
    return sorted(recs, key=lambda d: json.dumps(d, sort_keys=True))


def _task_record(task):
    # pylint: disable=protected-access
    storage = {}
    for path, st in (task.storage_mounts or {}).items():
        storage[path] = {
            'name': st.name,
            'source': st.source,
            'mode': _jsonable(st.mode),
            'persistent': st.persistent,
            'stores': sorted(_jsonable(list(st.stores.keys()))),
        }
    rec = {
        'name': task.name,
        'num_nodes': task.num_nodes,
        'envs': dict(task.envs),
        # Never record secret values.
        'secrets': sorted(task.secrets.keys()),
        'managed_secret_refs': [{
            'name': ref.name,
            'scope': ref.scope_override,
            'mount_path': ref.mount_path,
        } for ref in task.managed_secret_refs],
        'ordered': isinstance(task.resources, list),
        'workdir': _jsonable(task.workdir),
        'setup': task.setup,
        'run': task.run,
        'event_callback': task.event_callback,
        'file_mounts': task.file_mounts,
        'storage_mounts': storage,
        'volumes': _jsonable(task.volumes) or None,
        'inputs': task.inputs,
        'outputs': task.outputs,
        'has_service': task.service is not None,
        'resources': _resources_records(task),
    }
    # Snapshot: validation later mutates some of these in place (abspath).
    return copy.deepcopy(rec)


def _late_checks(task):
    """What SkyPilot validates only later (needs network/catalog/cluster)."""
    # pylint: disable=protected-access
    notes = []
    if isinstance(task.workdir, dict):
        notes.append('workdir git url/ref resolved at launch (git ls-remote; '
                     'GitError -> ValueError)')
    for r in task.resources:
        if r.cloud is None and (r.region is not None or r.zone is not None):
            notes.append('validate: cloud inferred from region/zone among '
                         'enabled clouds (ValueError if none/ambiguous)')
        elif r.region is not None or r.zone is not None:
            if str(r.cloud) in ('Kubernetes', 'SSH'):
                notes.append(f'validate: {str(r.cloud)} context '
                             f'{r.region!r} must exist in kubeconfig/allowed '
                             'contexts (ValueError otherwise)')
            else:
                notes.append(f'validate: region/zone checked against the '
                             f'{r.cloud} catalog (ValueError if unknown)')
        if r._instance_type is not None:
            notes.append('validate: instance_type checked against catalog '
                         '(ValueError "Invalid instance type"); cpus/memory '
                         'must match it')
        for acc in (r._accelerators or {}):
            if acc in CATALOG_NAMES or acc.startswith('tpu-'):
                continue
            notes.append(f'optimizer: accelerator {acc!r} is not in the '
                         'SkyPilot catalog; only a Kubernetes/Slurm/SSH '
                         'cluster advertising it can satisfy it, else '
                         'ResourcesUnavailableError at optimize time')
        if r.ports is not None:
            notes.append('validate: cloud must support OPEN_PORTS '
                         '(NotSupportedError/ValueError)')
        if r.disk_tier is not None and r.cloud is not None:
            notes.append('validate: disk_tier checked per cloud/instance '
                         '(ValueError if not supported)')
        if r.labels and r.cloud is None:
            notes.append('validate: labels checked against every enabled '
                         'cloud\'s label rules')
        if r.job_recovery is not None:
            notes.append('jobs: strategy name resolved by the jobs '
                         'controller via JOBS_RECOVERY_STRATEGY_REGISTRY; '
                         'all candidate resources must share one '
                         'job_recovery')
        if r.volumes:
            notes.append('validate: resources.volumes need cloud GCP')
        if r.image_id is not None:
            notes.append('provision: image_id existence checked by the '
                         'cloud at launch')
    if task.volumes:
        notes.append('validate: named volumes resolved against the volume '
                      'DB (resolve_and_validate_volumes)')
    if task.storage_mounts:
        notes.append('launch: storage buckets created/checked in the cloud '
                     '(sync_storage_mounts)')
    if task.service is not None:
        notes.append('service: only meaningful for `sky serve up`')
    # dedupe, keep order
    seen = set()
    return [n for n in notes if not (n in seen or seen.add(n))]


def _validate_offline(dag):
    """Runs the validation steps that can run offline, like sky launch.

    Mirrors sdk.validate (client: workdir + file_mounts paths) and the
    server's /validate (Task.validate with skip_file_mounts/skip_workdir):
    name, run, and per resource the offline-safe parts of
    Resources.validate(): accelerator canonicalisation, job_recovery strategy
    (server-side check), max_hourly_cost, labels when the cloud is known.
    """
    # pylint: disable=import-outside-toplevel,protected-access
    from sky.utils import annotations
    for task in dag.tasks:
        # Client side (sdk.validate).
        if not isinstance(task.workdir, dict):
            task.expand_and_validate_workdir()
        task.expand_and_validate_file_mounts()
        # Server side (/validate -> dag.validate()).
        task.validate_name()
        task.validate_run()
        annotations.is_on_api_server = True
        try:
            for r in task.resources:
                r._try_canonicalize_accelerators()
                r._try_validate_managed_job_attributes()
                r._try_validate_max_hourly_cost()
                if r.cloud is not None:
                    r._try_validate_labels()
        finally:
            annotations.is_on_api_server = False


def _jobs_launch_record(dag):
    """What `sky jobs launch` fills in before submitting (job_recovery)."""
    # pylint: disable=import-outside-toplevel
    from sky.utils import dag_utils
    dag = copy.deepcopy(dag)
    try:
        dag_utils.fill_default_config_in_dag_for_job_launch(dag)
    except Exception as e:  # pylint: disable=broad-except
        return {
            'ok': False,
            'error_class': type(e).__name__,
            'error': _first_line(e)
        }
    recs = []
    for task in dag.tasks:
        jrs = [_jsonable(r.job_recovery) for r in task.resources]
        recs.append(jrs[0] if jrs else None)
    return {'ok': True, 'job_recovery': recs if len(recs) > 1 else recs[0]}


def _load_overrides(case_path):
    side = os.path.splitext(case_path)[0] + '.env.json'
    if not os.path.exists(side):
        return None, None, None
    with open(side, encoding='utf-8') as f:
        spec = json.load(f)

    def _pairs(v):
        if v is None:
            return None
        if isinstance(v, dict):
            return [(str(k), str(val)) for k, val in v.items()]
        return [(str(k), str(val)) for k, val in v]

    return _pairs(spec.get('env')), _pairs(spec.get('secret')), spec


@contextlib.contextmanager
def _server_mode():
    """Act as the API server: strict schemas (plugins loaded)."""
    # pylint: disable=import-outside-toplevel
    from sky.server import plugins
    from sky.skylet import constants
    from sky.utils import annotations
    old_env = os.environ.get(constants.ENV_VAR_IS_SKYPILOT_SERVER)
    old_loaded = plugins.plugins_loaded
    os.environ[constants.ENV_VAR_IS_SKYPILOT_SERVER] = '1'
    plugins.plugins_loaded = lambda: True
    annotations.is_on_api_server = True
    try:
        yield
    finally:
        annotations.is_on_api_server = False
        plugins.plugins_loaded = old_loaded
        if old_env is None:
            os.environ.pop(constants.ENV_VAR_IS_SKYPILOT_SERVER, None)
        else:
            os.environ[constants.ENV_VAR_IS_SKYPILOT_SERVER] = old_env


def _load_like_cli(case_path, env, secret):
    """What `sky launch <yaml>` / `sky jobs launch <yaml>` do to load it."""
    # pylint: disable=import-outside-toplevel
    from sky.client.cli import command
    from sky.utils import dag_utils
    is_yaml, _, _, invalid_reason = command._check_yaml_only(case_path)  # pylint: disable=protected-access
    if not is_yaml:
        # The CLI asks "<path> looks like a yaml path but ... It will be
        # treated as a command to be run remotely. Continue?" (aborts when
        # not confirmed). Record what the Python API says too.
        try:
            dag_utils.load_chain_dag_from_yaml(case_path, env, secret)
            api = 'accepted'
        except Exception as e:  # pylint: disable=broad-except
            api = f'{type(e).__name__}: {_first_line(e)}'
        reason = invalid_reason.strip().splitlines()[0] if invalid_reason \
            else 'loads as a str, not a dict'
        raise CliNotYamlError(f'sky CLI: looks like a yaml path but {reason} '
                              f'(it would offer to run it as a shell '
                              f'command). Python API: {api}')
    if dag_utils.is_job_group_yaml(case_path):
        return dag_utils.load_job_group_from_yaml(case_path,
                                                  env_overrides=env,
                                                  secrets_overrides=secret)
    dag = dag_utils.load_chain_dag_from_yaml(case_path,
                                             env_overrides=env,
                                             secret_overrides=secret)
    if not dag.tasks:
        # _make_task_or_dag_from_entrypoint_with_overrides asserts this.
        raise AssertionError('If you see this, please file an issue; '
                             f'tasks: {dag.tasks}')
    return dag


class CliNotYamlError(Exception):
    """The sky CLI would not treat the file as a task YAML."""


def _server_roundtrip(dag):
    """The client sends dump_dag_to_yaml_str(dag); the server re-parses it
    with strict (plugin-aware) schemas in /validate."""
    # pylint: disable=import-outside-toplevel
    from sky.utils import dag_utils
    dag_str = dag_utils.dump_dag_to_yaml_str(dag)
    with _server_mode():
        return dag_utils.load_dag_from_yaml_str(dag_str)


def run_case(case_path):
    # pylint: disable=import-outside-toplevel
    from sky.utils import annotations
    del _NETWORK_ATTEMPTS[:]
    env, secret, spec = _load_overrides(case_path)
    result = {}
    if spec is not None:
        result['overrides'] = {'env': spec.get('env'), 'secret': spec.get(
            'secret')}
    annotations.is_on_api_server = False  # like the CLI (client_api)
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        offline_notes = []
        try:
            dag = _load_like_cli(case_path, env, secret)
        except Exception as e:  # pylint: disable=broad-except
            result.update(_error_record(e, 'load'))
            if _NETWORK_ATTEMPTS:
                # SkyPilot needed the network (a catalog download) to parse
                # this; offline we cannot tell whether it would accept it.
                result['accepted'] = None
                result['undetermined_offline'] = (
                    'parsing needs a catalog download: '
                    f'{type(e).__name__}: {_first_line(e)[:200]}')
            dag = None
        if dag is not None:
            pre = [_task_record(t) for t in dag.tasks]
            try:
                _validate_offline(dag)
            except Exception as e:  # pylint: disable=broad-except
                result.update(_error_record(e, 'validate'))
                result['parsed'] = pre[0] if len(pre) == 1 else pre
                dag = None
        if dag is not None:
            n_before = len(_NETWORK_ATTEMPTS)
            try:
                _server_roundtrip(dag)
            except Exception as e:  # pylint: disable=broad-except
                if len(_NETWORK_ATTEMPTS) > n_before:
                    offline_notes.append(
                        'server round trip (dump + strict re-parse) needs a '
                        'catalog download; not checked offline: '
                        f'{type(e).__name__}')
                else:
                    result.update(_error_record(e, 'validate'))
                    result['parsed'] = pre[0] if len(pre) == 1 else pre
                    dag = None
    if _NETWORK_ATTEMPTS:
        result['network_attempted'] = sorted(set(_NETWORK_ATTEMPTS))
    if dag is None:
        return result
    records = []
    for task, pre_rec in zip(dag.tasks, pre, strict=True):
        rec = dict(pre_rec)
        # Resources after validation (canonical accelerator names).
        rec['resources'] = _resources_records(task)
        late = offline_notes + _late_checks(task)
        if late:
            rec['late_check'] = late
        records.append(rec)
    result['accepted'] = True
    result['dag_name'] = dag.name
    result['num_tasks'] = len(records)
    if len(records) == 1:
        result.update(records[0])
    else:
        result['tasks'] = records
    result['jobs_launch'] = _jobs_launch_record(dag)
    return result


def main():
    _setup_offline_home()
    _install_network_guard()
    import sky  # pylint: disable=import-outside-toplevel
    cases = sorted(f for f in os.listdir(CASES_DIR)
                   if f.endswith(('.yaml', '.yml')))
    verdicts = {}
    cwd = os.getcwd()
    # Relative workdir / file_mounts sources resolve against the CWD in
    # SkyPilot (not the YAML's directory): run from the cases dir.
    os.chdir(CASES_DIR)
    try:
        for name in cases:
            path = os.path.join(CASES_DIR, name)
            try:
                verdicts[name] = run_case(path)
            except Exception:  # pylint: disable=broad-except
                print(f'generator failure on {name}', file=sys.stderr)
                traceback.print_exc()
                raise
    finally:
        os.chdir(cwd)
    out = {
        'skypilot_version': sky.__version__,
        'loader': 'sky.utils.dag_utils.load_chain_dag_from_yaml + offline '
                  'validate (see generate_verdicts.py)',
        'cases': verdicts,
    }
    with open(OUT_PATH, 'w', encoding='utf-8') as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write('\n')
    n_ok = sum(1 for v in verdicts.values() if v.get('accepted'))
    print(f'{len(verdicts)} cases: {n_ok} accepted, '
          f'{len(verdicts) - n_ok} rejected -> {OUT_PATH}')


if __name__ == '__main__':
    main()
