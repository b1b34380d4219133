"""What an instance type carries: SkyPilot derives a candidate's accelerators from it.

SkyPilot's ``Resources.accelerators`` (sky/resources.py) is the YAML's ``accelerators``, else,
when the candidate's cloud is known, what its catalog says the ``instance_type`` carries:
``infra: aws`` + ``instance_type: p4d.24xlarge`` asks for 8 A100. This module is that lookup
for AWS, the one cloud here with instance types, offline and without boto3 (``validate``
imports it).

:data:`AWS` follows SkyPilot's AWS catalog (``AcceleratorName``/``AcceleratorCount`` of
catalogs/v8/aws/vms.csv, built by sky/catalog/data_fetchers/fetch_aws.py): the first
``GpuInfo``/``NeuronInfo``/``FpgaInfo`` device of ``DescribeInstanceTypes``, with that
fetcher's fixes (p3dn -> V100-32GB, p4de -> A100-80GB, p5e/p5en -> H200, g7e -> RTXPRO6000,
g6f/gr6f as a fraction of an L4). Source: EC2 ``DescribeInstanceTypes`` as shipped in moto 5.2
(``moto/ec2/resources/instance_types.json.gz``, checked by tests/unit/test_spec_derived.py),
plus the types still in SkyPilot's catalog that moto no longer lists (p3, g4ad, dl1).
Compiled 2026-12. A type not listed is left alone: its accelerators are what AWS reports when
the AWS backend looks it up.
"""

from __future__ import annotations

#: EC2 instance type -> (SkyPilot's accelerator name, accelerators per instance)
AWS: dict[str, tuple[str, float]] = {
    "dl1.24xlarge": ("Gaudi HL-205", 8),
    "f2.6xlarge": ("Virtex UltraScale+ (VU47P)", 1),
    "f2.12xlarge": ("Virtex UltraScale+ (VU47P)", 2),
    "f2.48xlarge": ("Virtex UltraScale+ (VU47P)", 8),
    "g4ad.xlarge": ("Radeon Pro V520", 1), "g4ad.2xlarge": ("Radeon Pro V520", 1),
    "g4ad.4xlarge": ("Radeon Pro V520", 1), "g4ad.8xlarge": ("Radeon Pro V520", 2),
    "g4ad.16xlarge": ("Radeon Pro V520", 4),
    "g4dn.xlarge": ("T4", 1), "g4dn.2xlarge": ("T4", 1), "g4dn.4xlarge": ("T4", 1),
    "g4dn.8xlarge": ("T4", 1), "g4dn.12xlarge": ("T4", 4), "g4dn.16xlarge": ("T4", 1),
    "g4dn.metal": ("T4", 8),
    "g5.xlarge": ("A10G", 1), "g5.2xlarge": ("A10G", 1), "g5.4xlarge": ("A10G", 1),
    "g5.8xlarge": ("A10G", 1), "g5.12xlarge": ("A10G", 4), "g5.16xlarge": ("A10G", 1),
    "g5.24xlarge": ("A10G", 4), "g5.48xlarge": ("A10G", 8),
    "g5g.xlarge": ("T4g", 1), "g5g.2xlarge": ("T4g", 1), "g5g.4xlarge": ("T4g", 1),
    "g5g.8xlarge": ("T4g", 1), "g5g.16xlarge": ("T4g", 2), "g5g.metal": ("T4g", 2),
    "g6.xlarge": ("L4", 1), "g6.2xlarge": ("L4", 1), "g6.4xlarge": ("L4", 1),
    "g6.8xlarge": ("L4", 1), "g6.12xlarge": ("L4", 4), "g6.16xlarge": ("L4", 1),
    "g6.24xlarge": ("L4", 4), "g6.48xlarge": ("L4", 8),
    "g6e.xlarge": ("L40S", 1), "g6e.2xlarge": ("L40S", 1), "g6e.4xlarge": ("L40S", 1),
    "g6e.8xlarge": ("L40S", 1), "g6e.12xlarge": ("L40S", 4), "g6e.16xlarge": ("L40S", 1),
    "g6e.24xlarge": ("L40S", 4), "g6e.48xlarge": ("L40S", 8),
    "g6f.large": ("L4", 0.125), "g6f.xlarge": ("L4", 0.125), "g6f.2xlarge": ("L4", 0.25),
    "g6f.4xlarge": ("L4", 0.5),
    "g7.2xlarge": ("RTX PRO 4500", 1), "g7.4xlarge": ("RTX PRO 4500", 1),
    "g7.8xlarge": ("RTX PRO 4500", 1), "g7.12xlarge": ("RTX PRO 4500", 2),
    "g7.24xlarge": ("RTX PRO 4500", 4), "g7.48xlarge": ("RTX PRO 4500", 8),
    "g7e.2xlarge": ("RTXPRO6000", 1), "g7e.4xlarge": ("RTXPRO6000", 1),
    "g7e.8xlarge": ("RTXPRO6000", 1), "g7e.12xlarge": ("RTXPRO6000", 2),
    "g7e.24xlarge": ("RTXPRO6000", 4), "g7e.48xlarge": ("RTXPRO6000", 8),
    "gr6.4xlarge": ("L4", 1), "gr6.8xlarge": ("L4", 1),
    "gr6f.4xlarge": ("L4", 0.5),
    "inf1.xlarge": ("Inferentia", 1), "inf1.2xlarge": ("Inferentia", 1),
    "inf1.6xlarge": ("Inferentia", 4), "inf1.24xlarge": ("Inferentia", 16),
    "inf2.xlarge": ("Inferentia2", 1), "inf2.8xlarge": ("Inferentia2", 1),
    "inf2.24xlarge": ("Inferentia2", 6), "inf2.48xlarge": ("Inferentia2", 12),
    "p3.2xlarge": ("V100", 1), "p3.8xlarge": ("V100", 4), "p3.16xlarge": ("V100", 8),
    "p3dn.24xlarge": ("V100-32GB", 8),
    "p4d.24xlarge": ("A100", 8),
    "p4de.24xlarge": ("A100-80GB", 8),
    "p5.4xlarge": ("H100", 1), "p5.48xlarge": ("H100", 8),
    "p5e.48xlarge": ("H200", 8),
    "p5en.48xlarge": ("H200", 8),
    "p6-b200.48xlarge": ("B200", 8),
    "p6-b300.48xlarge": ("B300", 8),
    "trn1.2xlarge": ("Trainium", 1), "trn1.32xlarge": ("Trainium", 16),
    "trn1n.32xlarge": ("Trainium", 16),
    "trn2.3xlarge": ("Trainium2", 1), "trn2.48xlarge": ("Trainium2", 16),
}


def accelerator_of(cloud: str | None, instance_type: str | None) -> tuple[str, float] | None:
    """(name, count) that ``instance_type`` carries on ``cloud`` (our cloud name), or None
    (no cloud, a cloud without a table, a type not listed, or a type without accelerators)."""
    if cloud == "aws" and instance_type:
        return AWS.get(instance_type)
    return None
