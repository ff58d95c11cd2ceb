"""The EC2, SSM and SQS calls the provider makes: synchronous boto3, counted, retried, never logging secrets.

Every call goes through ``Api._call`` so each one is counted in Prometheus
(``bigfleet_aws_api_calls_total{service,operation,outcome}``, its duration and
the retries botocore made). Throttling and transient errors are retried by
botocore's retry handler (``api.retry_mode``, default ``adaptive``: exponential
backoff with jitter plus client-side rate limiting once throttled). Request
bodies are never logged: botocore's own loggers are capped at WARNING, and
errors of calls that carry the bootstrap blob are reported by error code only.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
from prometheus_client import CollectorRegistry, Counter, Histogram

from bigfleet_provider_aws.config import Config

TAG_PROVIDER = "bigfleet:provider"
TAG_MACHINE = "bigfleet:machine-id"
TAG_OPERATION = "bigfleet:operation"
TAG_CAPACITY = "bigfleet:capacity-type"
TAG_CLUSTER = "bigfleet:cluster"
TAG_INTERRUPTION = "bigfleet:interruption"
TAG_RELEASED = "bigfleet:released"
TAG_METADATA_PREFIX = "bigfleet:md:"

# Tags are informational copies; EC2 allows 50 per resource, keys <= 128 and values <= 256 characters.
MAX_METADATA_TAGS = 30

for _name in ("botocore", "boto3", "urllib3", "s3transfer"):
    # At DEBUG botocore logs whole request bodies: the bootstrap blob would reach the log.
    logging.getLogger(_name).setLevel(logging.WARNING)


class AwsMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        kw: dict[str, Any] = {"registry": registry}
        self.calls = Counter("bigfleet_aws_api_calls_total", "AWS API calls by outcome (ok or the error code)",
                             ["service", "operation", "outcome"], **kw)
        self.seconds = Histogram("bigfleet_aws_api_call_duration_seconds", "AWS API call latency, retries included",
                                 ["service", "operation"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                 **kw)
        self.retries = Counter("bigfleet_aws_api_retries_total", "Retries botocore made (throttling, 5xx)",
                               ["service", "operation"], **kw)
        self.launched = Counter("bigfleet_aws_instances_launched_total", "RunInstances that launched an instance",
                                ["capacity_type"], **kw)
        self.adopted = Counter("bigfleet_aws_create_adopted_total",
                               "Creates that found their instance by its operation tag instead of launching one", **kw)
        self.interruptions = Counter("bigfleet_aws_spot_interruptions_total",
                                     "Spot interruption signals observed (warning, rebalance, interrupted)", ["kind"],
                                     **kw)
        self.spot_refresh = Counter("bigfleet_aws_spot_price_refresh_total", "Spot price refreshes",
                                    ["outcome"], **kw)


def error_code(exc: BaseException) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code") or "ClientError")
    return type(exc).__name__


class Api:
    """Thin synchronous wrapper; the backend runs each call in its thread pool."""

    def __init__(self, cfg: Config, metrics: AwsMetrics, session: boto3.session.Session | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.session = session or boto3.session.Session(region_name=cfg.region)
        creds = self.session.get_credentials()
        self.credential_source = getattr(creds, "method", "") if creds is not None else ""
        kw: dict[str, Any] = {}
        if creds is None and cfg.emulator_credentials:
            # Only with an endpoint_url (config validation): a local emulator accepts any key.
            kw = {"aws_access_key_id": "emulator", "aws_secret_access_key": "emulator"}
            self.credential_source = "emulator"
        conf = botocore.config.Config(
            region_name=cfg.region,
            retries={"mode": cfg.api.retry_mode, "max_attempts": cfg.api.max_attempts},
            connect_timeout=cfg.api.connect_timeout, read_timeout=cfg.api.read_timeout,
            max_pool_connections=cfg.api.max_pool_connections,
            user_agent_extra="bigfleet-provider-aws",
        )
        endpoint = cfg.endpoint_url or None
        self.ec2 = self.session.client("ec2", endpoint_url=endpoint, config=conf, **kw)
        self.ssm = self.session.client("ssm", endpoint_url=endpoint, config=conf, **kw)
        self.sqs = self.session.client("sqs", endpoint_url=endpoint, config=conf, **kw)

    def _call(self, service: str, op: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        outcome = "ok"
        try:
            out = fn(**kwargs)
            attempts = int((out or {}).get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)
            if attempts:
                self.metrics.retries.labels(service, op).inc(attempts)
            return out
        except Exception as exc:
            outcome = error_code(exc)
            if isinstance(exc, botocore.exceptions.ClientError):
                attempts = int(exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)
                if attempts:
                    self.metrics.retries.labels(service, op).inc(attempts)
            raise
        finally:
            self.metrics.calls.labels(service, op, outcome).inc()
            self.metrics.seconds.labels(service, op).observe(time.perf_counter() - t0)

    # ---- inventory facts -----------------------------------------------------------------------

    def instance_types(self, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        names = list(dict.fromkeys(names))
        out: dict[str, dict[str, Any]] = {}
        for i in range(0, len(names), 100):
            batch = names[i:i + 100]
            token = None
            while True:
                kw: dict[str, Any] = {"InstanceTypes": batch}
                if token:
                    kw["NextToken"] = token
                page = self._call("ec2", "DescribeInstanceTypes", self.ec2.describe_instance_types, **kw)
                for t in page.get("InstanceTypes", []):
                    out[t["InstanceType"]] = t
                token = page.get("NextToken")
                if not token:
                    break
        return out

    def spot_prices(self, names: Iterable[str], zones: set[str]) -> dict[tuple[str, str], float]:
        """The newest spot price per (instance type, zone) for Linux, from DescribeSpotPriceHistory."""
        names = list(dict.fromkeys(names))
        newest: dict[tuple[str, str], tuple[datetime, float]] = {}
        now = datetime.now(UTC)
        for i in range(0, len(names), 50):
            kw: dict[str, Any] = {"InstanceTypes": names[i:i + 50], "StartTime": now,
                                  "ProductDescriptions": ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"]}
            while True:
                page = self._call("ec2", "DescribeSpotPriceHistory", self.ec2.describe_spot_price_history, **kw)
                for sp in page.get("SpotPriceHistory", []):
                    key = (sp.get("InstanceType", ""), sp.get("AvailabilityZone", ""))
                    if key[1] not in zones:
                        continue
                    try:
                        price = float(sp["SpotPrice"])
                    except (KeyError, ValueError):
                        continue
                    ts = sp.get("Timestamp") or now
                    if key not in newest or ts > newest[key][0]:
                        newest[key] = (ts, price)
                token = page.get("NextToken")
                if not token:
                    break
                kw["NextToken"] = token
        return {k: v[1] for k, v in newest.items()}

    def managed_instances(self) -> list[dict[str, Any]]:
        """Every instance this provider launched (by its provider tag), in any state."""
        out: list[dict[str, Any]] = []
        kw: dict[str, Any] = {"Filters": [{"Name": f"tag:{TAG_PROVIDER}", "Values": [self.cfg.provider_name]}],
                              "MaxResults": 1000}
        while True:
            page = self._call("ec2", "DescribeInstances", self.ec2.describe_instances, **kw)
            for res in page.get("Reservations", []):
                out.extend(res.get("Instances", []))
            token = page.get("NextToken")
            if not token:
                return out
            kw["NextToken"] = token

    # ---- lifecycle -----------------------------------------------------------------------------

    def find_by_operation(self, token: str) -> dict[str, Any] | None:
        """The live instance an earlier attempt of this operation launched, if any (pre-launch lookup)."""
        page = self._call("ec2", "DescribeInstances", self.ec2.describe_instances, Filters=[
            {"Name": f"tag:{TAG_OPERATION}", "Values": [token]},
            {"Name": f"tag:{TAG_PROVIDER}", "Values": [self.cfg.provider_name]},
            {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]},
        ])
        found = [i for r in page.get("Reservations", []) for i in r.get("Instances", [])]
        if not found:
            return None
        first = sorted(found, key=lambda i: (i.get("LaunchTime") or datetime.min.replace(tzinfo=UTC),
                                             i["InstanceId"]))[0]
        return dict(first)

    def run_instance(self, *, instance_type: str, zone: str, token: str, tags: dict[str, str], spot: bool,
                     reservation_id: str = "") -> dict[str, Any]:
        launch = self.cfg.launch
        kw: dict[str, Any] = {
            "ImageId": launch.image_id, "InstanceType": instance_type, "MinCount": 1, "MaxCount": 1,
            "ClientToken": token,
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]},
            ],
        }
        subnet = launch.subnets.get(zone)
        if subnet:
            kw["SubnetId"] = subnet
        else:
            kw["Placement"] = {"AvailabilityZone": zone}
        if launch.security_group_ids:
            kw["SecurityGroupIds"] = list(launch.security_group_ids)
        if launch.iam_instance_profile:
            key = "Arn" if launch.iam_instance_profile.startswith("arn:") else "Name"
            kw["IamInstanceProfile"] = {key: launch.iam_instance_profile}
        if launch.key_name:
            kw["KeyName"] = launch.key_name
        if launch.user_data:
            kw["UserData"] = base64.b64encode(launch.user_data).decode()
        if spot:
            kw["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        if reservation_id:
            kw["CapacityReservationSpecification"] = {
                "CapacityReservationTarget": {"CapacityReservationId": reservation_id}}
        out = self._call("ec2", "RunInstances", self.ec2.run_instances, **kw)
        instances = out.get("Instances") or []
        if not instances or not instances[0].get("InstanceId"):
            raise RuntimeError("RunInstances returned no instance")
        return dict(instances[0])

    def describe_instance(self, instance_id: str) -> dict[str, Any] | None:
        try:
            page = self._call("ec2", "DescribeInstances", self.ec2.describe_instances, InstanceIds=[instance_id])
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) == "InvalidInstanceID.NotFound":
                return None
            raise
        for r in page.get("Reservations", []):
            for i in r.get("Instances", []):
                return dict(i)
        return None

    def terminate(self, instance_id: str) -> str:
        """Terminate; an instance that is already gone counts as terminated."""
        try:
            out = self._call("ec2", "TerminateInstances", self.ec2.terminate_instances, InstanceIds=[instance_id])
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) == "InvalidInstanceID.NotFound":
                return "terminated"
            raise
        for t in out.get("TerminatingInstances", []):
            return str(t.get("CurrentState", {}).get("Name", "shutting-down"))
        return "shutting-down"

    def tag(self, instance_id: str, tags: dict[str, str]) -> None:
        if tags:
            self._call("ec2", "CreateTags", self.ec2.create_tags, Resources=[instance_id],
                       Tags=[{"Key": k, "Value": v} for k, v in tags.items()])

    def untag(self, instance_id: str, keys: Iterable[str]) -> None:
        keys = list(keys)
        if keys:
            self._call("ec2", "DeleteTags", self.ec2.delete_tags, Resources=[instance_id],
                       Tags=[{"Key": k} for k in keys])

    # ---- SSM -----------------------------------------------------------------------------------

    def send_command(self, instance_id: str, script: str, comment: str, timeout_seconds: int) -> str:
        """Run a shell script through SSM; returns the command id. Errors carry the code, never the script."""
        try:
            out = self._call("ssm", "SendCommand", self.ssm.send_command, InstanceIds=[instance_id],
                             DocumentName=self.cfg.bootstrap.ssm_document, Comment=comment[:100],
                             TimeoutSeconds=max(30, min(int(timeout_seconds), 172800)),
                             Parameters={"commands": [script]})
        except botocore.exceptions.ClientError as exc:
            raise SsmError(error_code(exc)) from None
        return str(out["Command"]["CommandId"])

    def command_status(self, command_id: str, instance_id: str) -> tuple[str, str]:
        try:
            out = self._call("ssm", "GetCommandInvocation", self.ssm.get_command_invocation,
                             CommandId=command_id, InstanceId=instance_id)
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) == "InvocationDoesNotExist":
                return "Pending", "invocation not visible yet"
            raise
        return str(out.get("Status", "")), str(out.get("StatusDetails", ""))

    # ---- SQS (EventBridge spot notices) --------------------------------------------------------

    def receive_notices(self, queue_url: str, max_batches: int = 10) -> list[tuple[str, str, str]]:
        """(instance id, EventBridge detail-type, receipt handle) of queued EC2 interruption events."""
        out: list[tuple[str, str, str]] = []
        for _ in range(max_batches):
            page = self._call("sqs", "ReceiveMessage", self.sqs.receive_message, QueueUrl=queue_url,
                              MaxNumberOfMessages=10, WaitTimeSeconds=0)
            msgs = page.get("Messages") or []
            for m in msgs:
                iid, kind = parse_event(m.get("Body", ""))
                out.append((iid, kind, m["ReceiptHandle"]))
            if len(msgs) < 10:
                break
        return out

    def delete_notice(self, queue_url: str, receipt: str) -> None:
        self._call("sqs", "DeleteMessage", self.sqs.delete_message, QueueUrl=queue_url, ReceiptHandle=receipt)


class SsmError(RuntimeError):
    def __init__(self, code: str) -> None:
        super().__init__(f"ssm SendCommand failed: {code}")
        self.code = code


def parse_event(body: str) -> tuple[str, str]:
    """An EventBridge event (as EventBridge delivers it to SQS) -> (instance id, detail-type); '' when not ours."""
    try:
        ev = json.loads(body)
    except ValueError:
        return "", ""
    if not isinstance(ev, dict):
        return "", ""
    kind = str(ev.get("detail-type", ""))
    detail = ev.get("detail") if isinstance(ev.get("detail"), dict) else {}
    iid = str(detail.get("instance-id", "") if detail else "")
    if not iid:
        for r in ev.get("resources") or []:
            if isinstance(r, str) and "/i-" in r:
                iid = r.rsplit("/", 1)[-1]
                break
    return iid, kind


def tags_of(instance: dict[str, Any]) -> dict[str, str]:
    return {t.get("Key", ""): t.get("Value", "") for t in instance.get("Tags") or []}


def metadata_tags(md: dict[str, str]) -> dict[str, str]:
    """The shard metadata entries that fit EC2 tag limits, as ``bigfleet:md:<key>`` tags (informational)."""
    out: dict[str, str] = {}
    for k in sorted(md):
        v = md[k]
        key = TAG_METADATA_PREFIX + k
        if len(key) > 128 or len(v) > 256 or not (key + v).isprintable():
            continue
        out[key] = v
        if len(out) >= MAX_METADATA_TAGS:
            break
    return out
