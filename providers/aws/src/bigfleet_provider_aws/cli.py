"""`bigfleet-provider-aws`: the AWS EC2 capacity provider daemon.

    bigfleet-provider-aws --config aws.yaml --listen 0.0.0.0:9400 --state-file /var/lib/bigfleet-aws/state.json

Credentials and region come from the standard boto3 chain (environment, shared config/credentials files,
web identity / IRSA, ECS/EC2 instance roles); ``--region`` and ``--endpoint-url`` override the file.
"""

from __future__ import annotations

import argparse
import sys

from botocore.exceptions import BotoCoreError, ClientError

from bigfleet.observability import configure_logging, get_logger, new_registry
from bigfleet.provider.kit import KitOptions
from bigfleet.provider.kit.runner import add_common_args, run
from bigfleet_provider_aws.aws import Api, AwsMetrics
from bigfleet_provider_aws.backend import AwsBackend
from bigfleet_provider_aws.config import ConfigError, load_config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bigfleet-provider-aws", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, default_listen="127.0.0.1:9400")
    p.add_argument("--config", required=True, metavar="FILE", help="supply model and launch settings (YAML)")
    p.add_argument("--region", default="", help="AWS region (overrides the file; else the file's region)")
    p.add_argument("--endpoint-url", default="",
                   help="EC2/SSM/SQS endpoint, for local EC2-compatible emulators such as moto (overrides the file)")
    p.add_argument("--seed-count", type=int, default=None,
                   help="testing: spread this many SPECULATIVE slots over the configured pools instead of their "
                        "slot counts (conformance passes {seed_count})")
    # Spot prices and interruption signals reach the shard through the kit's periodic reconcile.
    p.set_defaults(reconcile_interval=60.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.seed_count is not None and args.seed_count < 0:
        print("bigfleet-provider-aws: --seed-count must be >= 0", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, region=args.region, endpoint_url=args.endpoint_url)
    except ConfigError as exc:
        print(f"bigfleet-provider-aws: {exc}", file=sys.stderr)
        return 2
    registry = new_registry(process_metrics=True)
    api = Api(cfg, AwsMetrics(registry))
    if not api.credential_source:
        print("bigfleet-provider-aws: no AWS credentials found (environment, shared files, web identity or "
              "instance role); for a local emulator set emulator_credentials: true", file=sys.stderr)
        return 2
    backend = AwsBackend(cfg, api, seed_count=args.seed_count)
    configure_logging(args.log_level, args.log_format, component="aws-provider")
    get_logger("bigfleet.provider.aws").info(
        "aws provider configured", region=cfg.region, endpoint_url=cfg.endpoint_url or None,
        credentials=api.credential_source, slots=len(backend.slots), config=cfg.source)
    try:
        return run(backend, args, KitOptions(), component="aws-provider", registry=registry)
    except (BotoCoreError, ClientError, RuntimeError, TimeoutError) as exc:
        # Start-up failures (unknown instance types, AWS unreachable, bad credentials): one clear line.
        print(f"bigfleet-provider-aws: cannot start: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
