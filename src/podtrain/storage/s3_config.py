"""Where an ``s3://`` url goes: bucket and key prefix, endpoint and region, as the AWS SDKs decide them.

Endpoint: ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL`` (the SDKs' service-specific and global
variables), unless ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`` is true; a custom endpoint (MinIO, moto, an
on-premises gateway) is addressed path-style. Region: ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the
profile's ``region`` in the AWS config file, else us-east-1. Credentials are not read here: the S3
client takes them from the standard chain (environment, profile, IRSA, EKS Pod Identity, IMDS).
"""

from __future__ import annotations

import configparser
import os
from dataclasses import dataclass
from pathlib import Path

from podtrain.storage.errors import StorageError

DEFAULT_REGION = "us-east-1"


@dataclass(frozen=True)
class S3Location:
    """An ``s3://bucket/prefix`` url split up."""

    bucket: str
    prefix: str
    """The key prefix of the store's root: "" or ending in "/"."""

    def key(self, name: str) -> str:
        """The object key of the store-relative ``name``."""
        return self.prefix + name


def parse_s3_url(url: str) -> S3Location:
    """Bucket and key prefix of ``s3://bucket[/prefix]`` (a one-line ``StorageError`` if malformed)."""
    rest = url[len("s3://"):] if url.startswith("s3://") else ""
    bucket, _, prefix = rest.partition("/")
    if not bucket or len(bucket) < 3 or "@" in bucket or ":" in bucket:
        raise StorageError(url, "not an S3 url: expected s3://BUCKET/PREFIX (bucket names have 3-63 characters)")
    prefix = prefix.strip("/")
    return S3Location(bucket, prefix + "/" if prefix else "")


def endpoint_url(env=os.environ) -> str | None:
    """The custom S3 endpoint the AWS SDKs would use, or None for AWS's own."""
    if env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    return env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None


def _profile_region(env) -> str | None:
    """The ``region`` of the active profile in the AWS config file, if it names one."""
    path = Path(env.get("AWS_CONFIG_FILE") or Path.home() / ".aws" / "config").expanduser()
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    parser = configparser.RawConfigParser()
    try:
        parser.read(path)
    except (OSError, configparser.Error):
        return None
    for section in (f"profile {profile}", profile):
        if parser.has_option(section, "region"):
            return parser.get(section, "region").strip() or None
    return None


def region(env=os.environ) -> str:
    """The region the AWS SDKs would use: environment, then the profile, then us-east-1."""
    return env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or _profile_region(env) or DEFAULT_REGION


def profile(env=os.environ) -> str | None:
    """The named profile (``AWS_PROFILE``) for credentials, or None for the default chain."""
    return env.get("AWS_PROFILE") or None
