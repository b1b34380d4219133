"""What an AWS error means: AWS throttling a call is "cannot ask now", never an answer."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from airflow_skypilot.backends.aws.clients import AwsClients
from airflow_skypilot.backends.aws.quotas import QUOTA_CODES, Quotas
from airflow_skypilot.exceptions import BackendUnreachable


class _Throttled:
    def __init__(self, code: str):
        self.code = code

    def get_service_quota(self, **kw):
        raise ClientError({"Error": {"Code": self.code, "Message": "Rate exceeded"}},
                          "GetServiceQuota")


class _Clients(AwsClients):
    def __init__(self, code: str):
        super().__init__("aws_t")
        self.code = code

    def client(self, service, region, attempts=3):
        assert service == "service-quotas"
        return _Throttled(self.code)


@pytest.mark.parametrize("code", ["TooManyRequestsException", "RequestThrottledException",
                                  "ThrottledException", "PriorRequestNotComplete"])
def test_a_throttled_quota_lookup_is_unreachable_not_an_unknown_quota(code):
    cls, spot = next(iter(QUOTA_CODES))
    quotas = Quotas(_Clients(code))
    with pytest.raises(BackendUnreachable):
        quotas.limit("us-east-1", cls, spot)
