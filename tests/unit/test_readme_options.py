"""The README's operator docs say what the code does: its ``[skypilot]`` options table lists
exactly the options the provider declares (``get_provider_info()["config"]``), with their types,
defaults and descriptions; its IAM policy allows exactly the AWS API calls the AWS backend makes.

To regenerate the table after changing an option::

    python -m tests.unit.test_readme_options
"""

from __future__ import annotations

import re
from pathlib import Path

from airflow_skypilot.get_provider_info import get_provider_info

README = Path(__file__).resolve().parents[2] / "README.md"
HEADER = "| option | type | default | what it does |\n|---|---|---|---|"


def options() -> dict[str, dict]:
    return get_provider_info()["config"]["skypilot"]["options"]


def row(name: str, option: dict) -> str:
    default = f"`{option['default']}`" if option.get("default") else "(empty)"
    text = " ".join(option["description"].split()).replace("``", "`")
    return f"| `{name}` | {option['type']} | {default} | {text} |"


def table() -> str:
    return "\n".join([HEADER, *(row(n, o) for n, o in options().items())])


def _readme_table() -> str:
    text = README.read_text()
    start = text.index(HEADER)
    end = text.find("\n\n", start)
    return text[start:end if end >= 0 else len(text)]


def test_the_readme_lists_exactly_the_declared_options():
    listed = re.findall(r"^\| `([a-z_]+)` \|", _readme_table(), re.M)
    assert listed == list(options())
    assert _readme_table() == table()


#: IAM actions of S3 operations named otherwise
_S3_ACTIONS = {"ListObjectsV2": "s3:ListBucket"}
_IAM_PREFIX = {"ec2": "ec2", "s3": "s3", "ssm": "ssm", "service-quotas": "servicequotas"}


def _aws_calls() -> set[str]:
    """IAM actions of every AWS operation the AWS backend's code calls (a client method or a
    paginator named like one of the services' operations)."""
    import botocore.session
    from botocore import xform_name

    source = "\n".join(p.read_text() for p in
                       (README.parent / "airflow_skypilot" / "backends" / "aws").glob("*.py"))
    called = set(re.findall(r"\.([a-z0-9_]+)\(", source))
    called |= set(re.findall(r"get_paginator\(\"([a-z0-9_]+)\"\)", source))
    session = botocore.session.get_session()
    actions = set()
    for service, prefix in _IAM_PREFIX.items():
        for op in session.get_service_model(service).operation_names:
            if xform_name(op) in called:
                actions.add(_S3_ACTIONS.get(op, f"{prefix}:{op}"))
    return actions


def test_the_readme_iam_policy_allows_exactly_the_calls_the_aws_backend_makes():
    import json

    text = README.read_text()
    section = text[text.index("**AWS.** What the Airflow identity calls"):]
    policy = json.loads(section[section.index("```json\n") + 8:section.index("```\n", 8)])
    allowed = set()
    for statement in policy["Statement"]:
        action = statement["Action"]
        allowed |= {action} if isinstance(action, str) else set(action)
    calls = _aws_calls()
    assert "ec2:RunInstances" in calls and "s3:ListBucket" in calls  # the scan finds them
    # iam:PassRole is what RunInstances needs to give the instances their role
    assert allowed - {"iam:PassRole"} == calls


if __name__ == "__main__":
    print(table())
